"""Stage tokenize. Entry: ``fineflow.stages.tokenize``.

template.py       the prompt/chat template shared by training, validation and evaluation
conversation.py   which text of a conversation's real chat-template rendering each assistant turn is
tokenization.py   streaming parallel tokenization and content-addressed shard builds
shards.py         packing, the memory-mapped shard format and the training sampler that reads it
"""
