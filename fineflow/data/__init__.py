"""Stages data and validate (and fingerprint's data.sources). Entries: ``fineflow.stages.data``,
``fineflow.stages.validate``.

synth.py       the bundled synthetic instruction dataset (seeded, with injected bad rows), and as preference pairs
formats.py     reading user files: JSONL, CSV or Parquet, chat ``messages``, the column mapping (``data.mapping``)
conversations.py  chat messages and tool calls in normal form, and the checks of a conversation's turns
checks.py      every validation check, each declared once (``CHECKS``)
validation.py  the data gate: the suite over parsed rows, quarantine, whether the file passes
gx_suite.py    the great-expectations side: a chunk's suite on its frame, Data Docs of a split
tokens.py      how the tokenize stage will see a row, for the token checks
overlap.py     exact and near duplicates and train/eval leakage, remembered as hashes
pii.py         PII detection and typed placeholders (redaction)
secrets.py     secrets found by what they are (key formats, private keys, keyword + entropy)
sources.py     ``data.sources``: each source's kind (file, shards, saved, hub), its content hash, its rows
source_gate.py the gate over one source, its result kept by content (what a re-run reads back)
mix.py         the kept rows of the sources mixed by weight or count, deterministically in seed, streamed
mixture.py     the validate stage with data.sources: the eval split, each source, their mix and sources.json
"""
