"""Stage export's library: the promoted champion as GGUF files for llama.cpp (with an Ollama Modelfile) and laid
out for vLLM, and the parity check that can refuse each GGUF (tokenizer ids, chat template, stop tokens, scores on
the eval docs).

    tooling.py        llama.cpp's converter (out of llama-cpp-python's sdist, sha256-checked) and its runtime, pinned
    run_converter.py  convert_hf_to_gguf.py run unchanged, naming GPT-2's byte-level pre-tokenizer where it refuses
    gguf.py           the float GGUF by llama.cpp's converter, the quantized ones by its quantizer
    native_log.py     llama.cpp's own output (its log, the quantizer's and loader's writes to fds 1/2) into a log file
    parity.py         the checks: the GGUF through llama.cpp against the training tokenizer and the merged model
    exporter.py       the champion's merged model found or built, exported and checked: the stage's report
    exports_card.py   the exports' model card (models/export/README.md): each file, its parity, how to serve it
    serve.py          `fineflow serve`: the shippable GGUF export.json names, by llama-cpp-python's OpenAI server
    ollama.py         the Ollama Modelfile: TEMPLATE derived from the training chat template (verified), stops
    vllm.py           the adapter laid out as vLLM's LoRA loader reads it, its refusals, the `vllm serve` commands

Needs the ``export`` extra (``make export-tools``). Entry: ``fineflow.stages.export`` (stage export in dvc.yaml).
"""
