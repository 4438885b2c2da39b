"""Stage tokenize. Entry: ``fineflow.stages.tokenize``.

template.py       the prompt/chat template shared by training, validation and evaluation
conversation.py   which text of a conversation's real chat-template rendering each assistant turn is
tokenization.py   streaming parallel tokenization and content-addressed shard builds
pairs.py          preference pairs (train.objective dpo, simpo): each side rendered as SFT, a pair packed in one row
shards.py         packing, the memory-mapped shard format and the training sampler that reads it
"""
