"""Stage promote's library: the model registry on disk and what decides and installs a champion.

    gate.py      the statistics (paired bootstrap) and the promotion decision, on numbers only
    store.py     registry files: ids, hashes, candidates, champion swap and alias, hash-chained log, history
    card.py      the champion's model card (README.md)
    champion.py  the promote procedure, the champion's assembly (merged model, tokenizer, card) and rollback
    lineage.py   lineage manifests: building, checking, reading and printing them

Entry: ``fineflow.stages.promote``; the ``fineflow registry`` and ``fineflow lineage`` CLI use it too."""
