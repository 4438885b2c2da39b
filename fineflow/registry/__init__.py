"""Stage promote's library: the model registry on disk and what decides and installs a champion.

    gate.py      the statistics (paired bootstrap) and the promotion decision, on numbers only
    store.py     registry files: ids, the write lock, candidates, champion swap and alias, hash-chained log,
                 its repair after a crash, verify
    card.py      the champion's model card (README.md)
    champion.py  the promote procedure, the champion's assembly (merged model, tokenizer, card), rollback and
                 recover (finishing what a writer that died left)
    lineage.py   lineage manifests: building, checking, reading and printing them
    dvc_record.py  a rollback (a registry write made outside `dvc repro`) recorded in dvc.lock

Entry: ``fineflow.stages.promote``; the ``fineflow registry`` and ``fineflow lineage`` CLI use it too."""
