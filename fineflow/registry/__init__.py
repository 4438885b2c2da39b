"""Stage promote's library: the model registry on disk and what decides and installs a champion.

    gate.py      the statistics (paired bootstrap) and the promotion decision, on numbers only
    store.py     the registry on disk: ids, the write lock, stored candidates, the champion alias
    promotion_log.py  the hash-chained (optionally keyed) promotion log and its HEAD: append, read, its repair
                 after a crash, its chain, HEAD and HMAC checks
    install.py   the champion directory: its record, the staging sibling, the atomic swap, leftovers
    verify.py    `fineflow registry verify`: the log, its overrides, the candidates, the alias and the champion
                 (every file against the entry that installed it; an adapter-only champion's base), checked
    card.py      the champion's model card (README.md)
    champion.py  the promote procedure, the champion's assembly (merged model, tokenizer, card), rollback and
                 recover (finishing what a writer that died left)
    merge.py     the merged model of an adapter-only champion, built when asked, one base shard at a time
                 (`python -m fineflow.registry.merge`)
    lineage.py   lineage manifests: building, checking, reading and printing them
    approval.py  a person's approval of what the gate would promote (``promote.require_approval``)
    reward_champion.py  the champion reward model found, loaded on its base and run on rows (`fineflow reward
                 score`, and the online-RL reward of that model)
    dvc_record.py  a rollback (a registry write made outside `dvc repro`) recorded in dvc.lock

Entry: ``fineflow.stages.promote``; the ``fineflow registry`` and ``fineflow lineage`` CLI use it too."""
