"""The bottleneck doctor: reads a run's ledger and names what starved the devices, with the evidence, its share of
the run's time and money, and the param to change.

    fineflow doctor [reports/goodput.json] [--json] [--fail-on severe|warn|never]

The eight causes and the evidence each reads (thresholds below, as shares of the training loop's wall time
unless said otherwise):

- data_loading: the loop waiting for batches (loop data wait); fix ``train.prefetch``.
- cpu_preprocessing: tokenizing while training (the loader's preprocessing time), or the tokenize stage taking a
  large share of the run; fix: pre-tokenize (the tokenize stage's shards) / ``tokenize.workers``.
- checkpoint: the loop blocked on saves; fix ``checkpoint.mode: async`` or a larger ``checkpoint.every_steps``.
- network_sync: the gradient and loss all-reduces; fix ``train.grad_accum`` (fewer syncs per token).
- orchestration: DVC/Prefect gaps and process start-ups as a share of the whole run; fix: more work per run
  (``train.steps``), fewer re-runs.
- vram: the measured peak against the device's memory (overflow, near miss), a plan that did not fit as asked
  (auto_fit had to change it); fix ``train.gradient_checkpointing`` / ``train.micro_batch_size`` / ``train.method``.
- precision: fp32 on a device whose bf16 matmuls run at >= 1.5x fp32's rate (measured on a CPU, the datasheets' ratio
  on a GPU); fix ``train.precision: bf16``. A CPU probe whose interleaved rounds disagree (their interquartile range
  over 25% of the median ratio: a busy machine) is only an info finding, "inconclusive: machine busy".
- cpu_oversubscription: more threads than usable CPUs (the ranks on the machine x each one's torch threads) or,
  sampled during the loop, at least twice as many runnable threads on the machine as it has CPUs (other jobs
  included: fineflow.train.report.cpu_facts); fix ``train.threads`` (each rank its share of the CPUs, the default:
  fineflow.core.threads) or fewer ranks. At torch's default thread count per process a busy 2-core machine trained
  10-75x slower. An oversubscribed CPU run's precision is not judged (its time measured the contention).

Online RL (an objective that generates its batches: train.objective grpo) adds three, read from the loop's rollout
spans and the train report's rollout sums:

- rollout: generating the completions as a share of the loop (RL's usual bottleneck); fix
  ``train.grpo.max_completion_tokens`` (completions cut shorter) or fewer completions per prompt.
- no_signal: groups whose completions all scored alike, so their advantage is 0 and they teach nothing, as a
  share of all groups; it says whether they were all rewarded (too easy: harder prompts, a higher temperature) or
  none was (too hard: train SFT first, or more completions per prompt, ``train.grpo.group_size``).
- reward_errors: reward batches that failed (a user function that raised or ran past its time limit: scored
  ``on_error``); fix the function named in ``train.grpo.rewards``.

Findings are ordered by severity, then by their share of the run. Exit 1 when a finding reaches ``--fail-on``
(default severe), so CI can fail a run that wasted its devices; 2 on an unreadable ledger.
"""

from __future__ import annotations

SEVERITY_RANK = {"severe": 2, "warn": 1, "info": 0}
# (warn, severe) thresholds
LOOP_SHARE = {
    "data_loading": (0.05, 0.15),
    "cpu_preprocessing": (0.05, 0.15),
    "checkpoint": (0.05, 0.15),
    "network_sync": (0.10, 0.25),
}
RUN_SHARE = {"orchestration": (0.40, 0.65), "tokenize_stage": (0.25, 0.50)}
# fixed overhead below this is never severe, whatever its share: a short run's minute of start-up is worth a
# warning, not a failed CI job
SEVERE_OVERHEAD_S = 120.0
# a loop stall below this, in all, is never severe whatever its share: in a loop of a second or two the one final
# save or the first batch is most of it (a smoke run, not a starved device)
SEVERE_LOOP_S = 1.0
MIN_BF16_SPEEDUP = 1.5  # bf16's matmul rate over fp32's (fineflow.train.flops.bf16_speedup) worth a finding
MEMORY_SHARE = (0.85, 0.95)  # the larger of measured peak and plan / device memory: near miss, (near) overflow
# the bf16 probe's interquartile range over its median ratio above which it proves nothing (a quiet machine: ~0.05;
# one whose load came and went during the probe: > 1)
MAX_PROBE_SPREAD = 0.25
ROLLOUT_SHARE = (0.60, 0.80)  # generation's share of an online objective's loop: (warn, severe)
NO_SIGNAL_SHARE = (0.50, 0.80)  # groups without a learning signal, of all groups: (warn, severe)
REWARD_ERROR_SHARE = 0.10  # failed reward batches per group above which a reward error is severe
THREADS_PER_CORE = (1.0, 2.0)  # the ranks' threads / cores above which (warn, severe)
# the machine's runnable threads during the loop / its CPUs at or above which (warn, severe): a run alone on the
# machine keeps about 1x (its threads, a loader thread now and then)
RUNNABLE_PER_CPU = (2.0, 3.0)


def _severity(share: float, thresholds: tuple[float, float]) -> str | None:
    warn, severe = thresholds
    return "severe" if share >= severe else "warn" if share >= warn else None


def _loop_severity(seconds: float, loop_s: float, cause: str) -> str | None:
    severity = _severity(seconds / loop_s, LOOP_SHARE[cause])
    return "warn" if severity == "severe" and seconds < SEVERE_LOOP_S else severity


def _finding(cause, severity, seconds, ledger, evidence, param, value, why) -> dict:
    total = ledger["total_s"] or 1.0
    run_usd = (ledger.get("cost") or {}).get("run_usd") or 0.0
    return {
        "cause": cause,
        "severity": severity,
        "seconds": round(seconds, 3),
        "share_of_run": round(seconds / total, 5),
        "usd": round(seconds / total * run_usd, 6),
        "evidence": evidence,
        "fix": {"param": param, "value": value, "why": why},
    }


def _loop_findings(ledger: dict, train: dict) -> list[dict]:
    """The training loop's stalls, each judged as a share of the loop's wall time: its input (tokenizing on the
    fly, or waiting for batches), checkpoint saves, all-reduces."""
    loop_s = float(train.get("loop_s") or 0.0)
    if loop_s <= 0:
        return []
    totals = train.get("loop_totals") or {}
    settings = ledger.get("settings") or {}
    found = (
        _input_stall(ledger, train, totals, settings, loop_s),
        _checkpoint_stall(ledger, totals, settings, loop_s),
        _sync_stall(ledger, train, totals, loop_s),
    )
    return [finding for finding in found if finding]


def _input_stall(ledger: dict, train: dict, totals: dict, settings: dict, loop_s: float) -> dict | None:
    """Tokenizing batches on the fly when it took at least half as long as the wait for batches (the wait is then
    its symptom); otherwise the wait itself."""
    preprocess = float(train.get("preprocess_s") or 0.0)
    wait = float(totals.get("data_wait_s") or 0.0)
    if preprocess >= 0.5 * wait and preprocess > 0:
        return _preprocessing_stall(ledger, preprocess, settings, loop_s)
    return _data_wait_stall(ledger, wait, settings, loop_s)


def _preprocessing_stall(ledger: dict, preprocess: float, settings: dict, loop_s: float) -> dict | None:
    severity = _loop_severity(preprocess, loop_s, "cpu_preprocessing")
    if not severity:
        return None
    return _finding(
        "cpu_preprocessing",
        severity,
        preprocess,
        ledger,
        f"the loop spent {preprocess:.1f} s tokenizing batches on the fly ({preprocess / loop_s:.0%} of its "
        f"{loop_s:.1f} s)",
        "tokenize.workers",
        max(2, int(settings.get("tokenize.workers") or 1) * 2),
        "tokenize ahead of training (the tokenize stage writes packed shards; more workers make it faster)",
    )


def _data_wait_stall(ledger: dict, wait: float, settings: dict, loop_s: float) -> dict | None:
    severity = _loop_severity(wait, loop_s, "data_loading")
    if not severity:
        return None
    prefetch = settings.get("train.prefetch")
    return _finding(
        "data_loading",
        severity,
        wait,
        ledger,
        f"the loop waited {wait:.1f} s for batches ({wait / loop_s:.0%} of its {loop_s:.1f} s); "
        f"train.prefetch is {prefetch}",
        "train.prefetch",
        max(2, 2 * int(prefetch or 0)),
        "prepare more steps of batches ahead on the loader thread",
    )


def _checkpoint_stall(ledger: dict, totals: dict, settings: dict, loop_s: float) -> dict | None:
    """The loop blocked on saves: async saves when they are sync, else saving less often."""
    stall = float(totals.get("checkpoint_s") or 0.0)
    severity = _loop_severity(stall, loop_s, "checkpoint")
    if not severity:
        return None
    mode = settings.get("checkpoint.mode")
    every = settings.get("checkpoint.every_steps")
    param, value, why = (
        ("checkpoint.mode", "async", "the loop blocks only while the state is copied to host memory")
        if mode == "sync"
        else ("checkpoint.every_steps", 2 * int(every or 1), "save less often")
    )
    return _finding(
        "checkpoint",
        severity,
        stall,
        ledger,
        f"the loop was blocked {stall:.1f} s by checkpoint saves ({stall / loop_s:.0%} of its {loop_s:.1f} s; "
        f"checkpoint.mode {mode}, every {every} steps)",
        param,
        value,
        why,
    )


def _sync_stall(ledger: dict, train: dict, totals: dict, loop_s: float) -> dict | None:
    """The gradient and loss all-reduces: fewer of them per token, by accumulating more micro-batches."""
    sync = float(totals.get("grad_sync_s") or 0.0) + float(totals.get("loss_sync_s") or 0.0)
    severity = _loop_severity(sync, loop_s, "network_sync")
    if not severity:
        return None
    accum = int(train.get("grad_accum") or 1)
    return _finding(
        "network_sync",
        severity,
        sync,
        ledger,
        f"the ranks spent {sync:.1f} s in all-reduces ({sync / loop_s:.0%} of the loop's {loop_s:.1f} s) over "
        f"{train.get('world_size')} processes; train.grad_accum is {accum}",
        "train.grad_accum",
        accum * 2,
        "fewer gradient syncs per trained token (keep the global batch by lowering train.micro_batch_size)",
    )


def _run_findings(ledger: dict) -> list[dict]:
    findings = []
    total = ledger["total_s"] or 1.0
    buckets = ledger["buckets"]
    overhead = buckets["orchestration"] + buckets["startup"]
    severity = _severity(overhead / total, RUN_SHARE["orchestration"])
    if severity == "severe" and overhead < SEVERE_OVERHEAD_S:
        severity = "warn"
    if severity:
        findings.append(
            _finding(
                "orchestration",
                severity,
                overhead,
                ledger,
                f"{buckets['orchestration']:.1f} s of DVC/Prefect between stages and {buckets['startup']:.1f} s of "
                f"process start-up ({overhead / total:.0%} of the {total:.1f} s run)",
                "train.steps",
                None,
                "more training per run amortizes the fixed cost; start runs from one flow (not stage by stage)",
            )
        )
    tokenize = buckets["tokenization"]
    severity = _severity(tokenize / total, RUN_SHARE["tokenize_stage"])
    if severity:
        workers = int((ledger.get("settings") or {}).get("tokenize.workers") or 1)
        findings.append(
            _finding(
                "cpu_preprocessing",
                severity,
                tokenize,
                ledger,
                f"the tokenize stage took {tokenize:.1f} s ({tokenize / total:.0%} of the run) on {workers} worker(s)",
                "tokenize.workers",
                workers * 2,
                "tokenize in more processes (the shards are identical for any count)",
            )
        )
    return findings


def _rollout_findings(ledger: dict, train: dict) -> list[dict]:
    """An online objective's: generation dominating the loop, groups without signal, failing rewards."""
    totals, loop_s = train.get("loop_totals") or {}, float(train.get("loop_s") or 0.0)
    sums = train.get("rollouts") or {}
    section = f"train.{train.get('objective')}"  # the objective's own settings, where its rollouts' are
    found = []
    rollout = float(totals.get("rollout_s") or 0.0)
    if loop_s > 0 and rollout > 0:
        severity = _severity(rollout / loop_s, ROLLOUT_SHARE)
        if severity:
            found.append(
                _finding(
                    "rollout",
                    severity,
                    rollout,
                    ledger,
                    f"generating the completions took {rollout:.1f} s, {rollout / loop_s:.0%} of the loop "
                    f"({float(totals.get('compute_s') or 0.0):.1f} s computing the loss)",
                    f"{section}.max_completion_tokens",
                    None,
                    f"shorter completions (or fewer per prompt, {section}.group_size) cut the generation time",
                )
            )
    groups = float(sums.get("groups") or 0.0)
    if groups > 0:
        found += [
            f
            for f in (_no_signal(ledger, sums, groups, loop_s, section), _reward_errors(ledger, sums, groups, section))
            if f
        ]
    return found


def _no_signal(ledger: dict, sums: dict, groups: float, loop_s: float, section: str) -> dict | None:
    flat, solved = float(sums.get("flat_groups") or 0.0), float(sums.get("flat_solved") or 0.0)
    severity = _severity(flat / groups, NO_SIGNAL_SHARE)
    if severity is None:
        return None
    too_easy = solved >= flat - solved
    which = (
        f"{solved:.0f} of them with every completion rewarded (too easy)"
        if too_easy
        else f"{flat - solved:.0f} of them with no completion rewarded (too hard)"
    )
    return _finding(
        "no_signal",
        severity,
        loop_s * flat / groups,  # the share of the loop spent on groups that taught nothing
        ledger,
        f"{flat:.0f} of {groups:.0f} groups ({flat / groups:.0%}) scored alike, no advantage, no gradient: {which}",
        f"{section}.temperature" if too_easy else f"{section}.group_size",
        None,
        "harder prompts, or a higher sampling temperature for more varied completions"
        if too_easy
        else "train on the task's answers first (supervised: train.preference.reference champion then starts from "
        "that model), or sample more completions per prompt",
    )


def _reward_errors(ledger: dict, sums: dict, groups: float, section: str) -> dict | None:
    errors = float(sums.get("reward_errors") or 0.0)
    if errors <= 0:
        return None
    severity = "severe" if errors / groups > REWARD_ERROR_SHARE else "warn"
    return _finding(
        "reward_errors",
        severity,
        0.0,
        ledger,
        f"{errors:.0f} reward batches failed (scored with on_error instead) over {groups:.0f} groups: the train "
        "report's reward errors name the reward and its exception",
        f"{section}.rewards",
        None,
        "a reward that raises or runs past its timeout_s scores nothing: fix the function, or raise its timeout_s",
    )


def _memory_findings(ledger: dict, train: dict) -> list[dict]:
    plan = train.get("plan") or {}
    device_bytes = plan.get("device_bytes")
    if not device_bytes:
        return []
    device_gib = device_bytes / 2**30
    peak_gib = float(train.get("peak_mem_mb") or 0.0) / 1024
    planned = plan.get("total_gib")
    changes = plan.get("changes") or []
    ratio = max(peak_gib, float(planned or 0.0)) / device_gib
    severity = _severity(ratio, MEMORY_SHARE)
    if severity is None and changes:
        severity = "warn"
    if severity is None:
        return []
    kind = "overflow" if ratio >= 1 else "near miss" if ratio >= MEMORY_SHARE[0] else "plan over budget"
    evidence = (
        f"{kind}: measured peak {peak_gib:.2f} GiB and planned {planned} GiB of {device_gib:.2f} GiB per device "
        f"({ratio:.0%})" + (f"; the plan did not fit and auto_fit changed it: {'; '.join(changes)}" if changes else "")
    )
    loop_s = float(train.get("loop_s") or 0.0)
    return [
        _finding(
            "vram",
            severity,
            loop_s if severity == "severe" else 0.0,  # a run at risk of OOM: its whole training is at stake
            ledger,
            evidence,
            "train.gradient_checkpointing" if not train.get("gradient_checkpointing") else "train.micro_batch_size",
            True if not train.get("gradient_checkpointing") else max(1, int(train.get("micro_batch_size") or 2) // 2),
            "less activation memory per device (or train.method: lora / qlora, or more devices)",
        )
    ]


def _precision_findings(ledger: dict, train: dict) -> list[dict]:
    device = train.get("device") or {}
    if train.get("precision") != "no" or not device.get("bf16_capable"):
        return []
    speedup = device.get("bf16_speedup")  # measured on a CPU, the datasheets' ratio on a known GPU
    spread = device.get("bf16_spread")  # the CPU probe's (None: the datasheets', or a report from before it)
    if spread is not None and spread > MAX_PROBE_SPREAD:
        return [_inconclusive_precision(ledger, device)]
    if speedup is not None and speedup < MIN_BF16_SPEEDUP:
        return []  # bf16 instructions, but not enough faster here to be worth the change
    compute = ledger["buckets"]["compute"]
    rate = (
        f"bf16 matmuls {'measured' if device.get('type') == 'cpu' else 'rated'} at {speedup:g}x fp32's rate there"
        if speedup
        else "it computes bf16 fast"
    )
    return [
        _finding(
            "precision",
            # on a GPU with bf16 tensor cores and on a CPU with AMX / AVX-512 BF16 alike (train.precision auto
            # resolves to fp32 on any CPU: set bf16 there by hand)
            "severe",
            # what bf16 would save, conservatively: not every op of a step is a matmul at the datasheet's rate
            # (an H100's 14.8x would claim 93%), so at most half of the compute
            compute * (1 - 1 / min(speedup or 2.0, 2.0)),
            ledger,
            f"trained in fp32 on {device.get('name')}; {rate}; compute took {compute:.1f} s",
            "train.precision",
            "bf16",
            "bf16 autocast: more matmul throughput and half the activation memory",
        )
    ]


def _inconclusive_precision(ledger: dict, device: dict) -> dict:
    """A bf16 probe whose rounds disagree: said, at info, so that nobody changes the precision on its word."""
    return _finding(
        "precision",
        "info",
        0.0,
        ledger,
        f"inconclusive: machine busy; bf16 matmuls measured at {device.get('bf16_speedup')}x fp32's rate (the median "
        f"of {device.get('bf16_rounds')} interleaved rounds) but the rounds spread over {device['bf16_spread']:.0%} "
        f"of it (a finding needs <= {MAX_PROBE_SPREAD:.0%})",
        "train.precision",
        None,
        "measure again on a quiet machine: bf16 pays where its matmuls run >= 1.5x fp32's rate",
    )


def _cpu_findings(ledger: dict, train: dict) -> list[dict]:
    """More runnable threads than CPUs: the ranks' own thread pools (ranks x threads over the usable CPUs) or,
    sampled during the loop, the whole machine's runnable threads over its CPUs (other jobs included). The fix
    gives each rank at most its share of the CPUs (fineflow.core.threads)."""
    cpu = (train.get("device") or {}).get("cpu") or {}
    cores = int(cpu.get("cores") or 0)
    if not cores:
        return []
    ranks, threads = int(cpu.get("local_ranks") or 1), int(cpu.get("threads_per_rank") or 1)
    load = float(cpu.get("load_1m") or 0.0)
    during = cpu.get("runnable_during") or {}
    machine_cpus = int(during.get("machine_cpus") or cores)
    runnable = float(during["mean"]) if during.get("mean") is not None else None
    own = ranks * threads / cores
    shared = runnable / machine_cpus if runnable is not None else load / cores
    severity = _severity(own, THREADS_PER_CORE) if own > THREADS_PER_CORE[0] else None
    if severity is None and shared >= RUNNABLE_PER_CPU[0]:
        severity = _severity(shared, RUNNABLE_PER_CPU)
    if severity is None:
        return []
    loop_s = float(train.get("loop_s") or 0.0)
    machine = (
        f"{runnable:.1f} runnable threads on average during the loop on {machine_cpus} CPUs ({shared:.1f}x, at most "
        f"{during.get('max')})"
        if runnable is not None
        else f"load average {load:.1f} over the run's last minute, {shared:.1f}x the cores"
    )
    return [
        _finding(
            "cpu_oversubscription",
            severity,
            # the loop's time lost to waiting for a core, conservatively: at most half of it
            loop_s * (1 - 1 / min(max(own, shared), 2.0)),
            ledger,
            f"{ranks} rank(s) x {threads} torch threads = {ranks * threads} threads on {cores} usable CPUs; {machine}",
            "train.threads",
            min(threads, max(1, cores // ranks)),
            "each rank at most its share of the usable CPUs (fineflow's default when neither train.threads nor "
            "OMP_NUM_THREADS is set), fewer ranks (train.num_processes), or a machine not shared with other jobs",
        )
    ]


def _not_judged_precision(ledger: dict, device: dict) -> dict:
    """fp32 on a CPU of an oversubscribed run: the bf16 probe timed a machine it shared, and the time went to
    waiting for a core, not to fp32's matmuls: said at info, so nobody changes the precision for it."""
    return _finding(
        "precision",
        "info",
        0.0,
        ledger,
        f"not judged: the run was oversubscribed (cpu_oversubscription), so its compute time and the bf16 probe "
        f"({device.get('bf16_speedup')}x fp32's rate) measured the contention, not the precision",
        "train.precision",
        None,
        "fix the oversubscription first, then measure again",
    )


def diagnose(ledger: dict) -> list[dict]:
    """The findings of a ledger, most severe and largest first (nothing when the run trained nothing)."""
    findings = _run_findings(ledger) if ledger.get("trained") else []
    train = ledger.get("train") or {}
    if train:
        cpu = _cpu_findings(ledger, train)
        precision = _precision_findings(ledger, train)
        device = train.get("device") or {}
        if cpu and device.get("type") == "cpu" and any(f["severity"] != "info" for f in precision):
            precision = [_not_judged_precision(ledger, device)]  # the contention, not fp32, cost that time
        findings += _loop_findings(ledger, train) + _memory_findings(ledger, train) + precision + cpu
        findings += _rollout_findings(ledger, train)
    return sorted(findings, key=lambda f: (-SEVERITY_RANK[f["severity"]], -f["share_of_run"]))


def worst(findings: list[dict]) -> str | None:
    return max((f["severity"] for f in findings), key=SEVERITY_RANK.get, default=None)


def one_line(ledger: dict) -> str:
    """`make run`'s last line: goodput, cost, and the biggest badput bucket."""
    cost = ledger.get("cost") or {}
    biggest = ledger.get("biggest_badput")
    money = f"${cost.get('run_usd', 0):.4f}"
    if cost.get("usd_per_1m_tokens") is not None:
        money += f" (${cost['usd_per_1m_tokens']:.4f} per 1M tokens)"
    line = (
        f"goodput {ledger['goodput']:.1%} of {ledger['total_s']:.0f} s, cost {money} at "
        f"${cost.get('device_hour_usd')}/device-hour x {cost.get('devices')}"
    )
    if biggest:
        line += f"; biggest badput: {biggest} {ledger['buckets'][biggest]:.1f} s (${cost['bucket_usd'][biggest]:.4f})"
    findings = ledger.get("findings") or []
    if findings:
        line += f"; doctor: {findings[0]['severity']} {findings[0]['cause']}"
    return line


def format_text(ledger: dict, findings: list[dict]) -> str:
    from fineflow.goodput.ledger import DESCRIPTIONS

    total = ledger["total_s"] or 1.0
    cost = ledger.get("cost") or {}
    lines = [one_line(ledger), "", f"{'bucket':<14} {'seconds':>9} {'share':>7} {'$':>10}  what"]
    for name, seconds in sorted(ledger["buckets"].items(), key=lambda item: -item[1]):
        usd = (cost.get("bucket_usd") or {}).get(name, 0.0)
        lines.append(f"{name:<14} {seconds:9.2f} {seconds / total:7.1%} {usd:10.5f}  {DESCRIPTIONS.get(name, '')}")
    lines.append(f"{'unaccounted':<14} {ledger['unaccounted_s']:9.2f} {ledger['unaccounted_share']:7.2%}")
    if ledger.get("mfu") is not None:
        lines.append(utilization_line(ledger))
    lines.append("")
    if not findings:
        lines.append("doctor: nothing found" + ("" if ledger.get("trained") else " (this run trained nothing)"))
    for i, finding in enumerate(findings, 1):
        fix = finding["fix"]
        setting = f"{fix['param']}: {fix['value']}" if fix["value"] is not None else fix["param"]
        lines.append(
            f"{i}. [{finding['severity']}] {finding['cause']}: {finding['share_of_run']:.0%} of the run, "
            f"${finding['usd']:.4f}\n   evidence: {finding['evidence']}\n   fix: {setting} ({fix['why']})"
        )
    return "\n".join(lines)


def utilization_line(ledger: dict) -> str:
    """MFU and HFU with their peak's source; inconclusive when the CPU probe of the peak spread over
    MAX_PROBE_SPREAD (a busy machine: the utilization is against a peak nobody measured)."""
    flops = (ledger.get("train") or {}).get("flops") or {}
    line = f"MFU {ledger['mfu']:.2%}, HFU {ledger['hfu']:.2%} (peak: {flops.get('peak_source')})"
    spread = flops.get("peak_spread")
    if spread is not None and spread > MAX_PROBE_SPREAD:
        line += (
            f"; inconclusive: machine busy, the peak probe's rounds spread over {spread:.0%} of their median "
            f"(a figure needs <= {MAX_PROBE_SPREAD:.0%}): measure again on a quiet machine"
        )
    return line
