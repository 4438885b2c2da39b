"""Stage export's library: the promoted champion in every export format (GGUF files for llama.cpp, an Ollama
Modelfile, the adapter laid out for vLLM), and the parity check that can refuse each GGUF (tokenizer ids, chat
template, stop tokens, scores on the eval docs).

    interface.py      the interface every format implements: ExportFormat (write, serving), ExportJob, Trained
    formats.py        the registry: FORMATS, in the order the stage asks them (a format after those it needs)
    gguf.py           the GGUF format: the float GGUF by llama.cpp's converter, the quantized ones by its quantizer,
                      each parity-checked; promote's check before installing (export.block_promotion)
    ollama.py         the Ollama format: the Modelfile, TEMPLATE derived from the training chat template (verified)
    vllm.py           the vLLM format: the adapter as vLLM's LoRA loader reads it, its refusals, `vllm serve` commands
    exporter.py       the champion's full model found or built, every format written: the report
    trained.py        the trained side the exports are held to: tokenizer, rendered eval docs, stop ids
    exports_card.py   the exports' model card (models/export/README.md): each GGUF, its parity, how to serve each
    parity.py         the checks: the GGUF through llama.cpp against the training tokenizer and the merged model
    serve.py          `fineflow serve`: the shippable GGUF export.json names, by llama-cpp-python's OpenAI server
    tooling.py        llama.cpp's converter (out of llama-cpp-python's sdist, sha256-checked) and its runtime, pinned
    run_converter.py  convert_hf_to_gguf.py run unchanged, naming GPT-2's byte-level pre-tokenizer where it refuses
    native_log.py     llama.cpp's own output (its log, the quantizer's and loader's writes to fds 1/2) into a log file

Adding a format: its module with an ExportFormat subclass, and its line in formats.py (docs/export.md). Needs the
``export`` extra (``make export-tools``). Entry: ``fineflow.stages.export`` (stage export in dvc.yaml).
"""
