"""Stage base: the embedded default base model (tokenizer trained with ``tokenizers``, a tiny Llama, a brief
pretraining). Entry: ``fineflow.stages.base``. Which base a later stage loads is ``fineflow.model_ref``."""
