"""Stage tokenize. Entry: ``fineflow.stages.tokenize``.

template.py       the prompt/chat template shared by training, validation and evaluation
tokenization.py   streaming parallel tokenization and content-addressed shard builds
shards.py         packing, the memory-mapped shard format and the training sampler that reads it
"""
