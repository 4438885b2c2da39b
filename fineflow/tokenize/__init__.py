"""Stage tokenize: the prompt/chat template (``template``), streaming parallel tokenization and
content-addressed shard builds (``tokenization``), packing and the memory-mapped shard format with the
training sampler that reads it (``shards``). Entry: ``fineflow.stages.tokenize``."""
