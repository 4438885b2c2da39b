"""A thin adapter around lm-eval's ``simple_evaluate`` (heavy imports inside functions).

Tasks come from three places, searched in this order:

1. the bundled folder (``fineflow/evaluate/bundled_tasks``), copied to a working directory with the eval rows'
   absolute path filled in;
2. ``evaluate.task_dirs``, the user's folders of task YAMLs, indexed where they are (the evaluate stage takes
   only folders under the project's ``eval_tasks/``, the one DVC tracks for it);
3. lm-eval's own registry, by name. Only when a name is in neither of the first two does lm-eval index its
   200+ built-in task folders (~10 s); local tasks alone never pay for it.

Every task is built once before any model is loaded, so a misspelt name, a broken user YAML or a registry
task whose dataset is not cached offline stops the stage with one clear ``FineflowError``.

One base model is loaded and scored plain, then under each LoRA adapter in turn (the candidate, then the
champion), never merged; peft's ``unload()`` swaps the LoRA layers back for the original modules after
each, so adapters never stack. A fully fine-tuned model (or a champion's merged model, or an adapter on its own
other base) is loaded on its own, in place of the base: one model's weights at a time, as the evaluation's memory
plan (``fineflow.evaluate.sizing``) counts them. Every model loads as ``LoadPlan`` says: the run's compute dtype,
one device or accelerate's device map across several, or the 4-bit base of a QLoRA run.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from fineflow.errors import FineflowError

BUNDLED_TASKS = Path(__file__).parent / "bundled_tasks"
CHAMPION_RECORD = "champion.json"


# ---------------------------------------------------------------- tasks


EVAL_ROWS = "eval_rows.jsonl"  # in the task dir: the eval rows with their prompts rendered as training rendered them


def prepare_task_dir(work_dir: Path, eval_file: Path, max_gen_toks: int, tokenizer=None, pairs: bool = False) -> Path:
    """Copy the bundled task YAMLs into work_dir with the eval file's absolute path substituted. With the base's
    tokenizer, the tasks read a copy of the eval rows whose prompts are rendered exactly as the tokenize stage
    rendered the training rows (``render_eval_rows``): chat rows through the tokenizer's chat template. pairs:
    the rows are preference pairs, whose chosen answer is the tasks' target (the SFT regression guard)."""
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True)
    if tokenizer is not None:
        eval_file = render_eval_rows(eval_file, tokenizer, work_dir / EVAL_ROWS, pairs)
    for source in BUNDLED_TASKS.iterdir():
        if source.suffix == ".yaml":
            text = source.read_text(encoding="utf-8")
            text = text.replace("{eval_file}", str(eval_file.resolve())).replace("{max_gen_toks}", str(max_gen_toks))
            (work_dir / source.name).write_text(text, encoding="utf-8")
        elif source.suffix == ".py":
            shutil.copy(source, work_dir / source.name)
    return work_dir


def render_eval_rows(eval_file: Path, tokenizer, out: Path, pairs: bool = False) -> Path:
    """Each eval row plus ``prompt`` and ``response_prefix``: the prompt text training put before the response
    (fineflow.tokenize.template.render_pair, the function the tokenize stage uses) and what the response text
    starts with before the answer (" " after the fineflow template, nothing after a chat template's generation
    prompt). The bundled tasks prompt with these, so a chat-trained model is evaluated in its chat format.
    pairs: each row is a preference pair, taken with its chosen answer as the reply (its ``output``), or a
    feedback row: its answer when desirable, left out when not."""
    from fineflow.evaluate.pair_ranking import answer_row
    from fineflow.tokenize.template import RenderError, render_pair

    with eval_file.open(encoding="utf-8") as rows, out.open("w", encoding="utf-8") as fh:
        for line_number, line in enumerate(rows, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if pairs and "chosen" not in row and row.get("label") is False:
                continue  # feedback rows (kto): a desirable answer is a target, an undesirable one never
            if pairs and "chosen" in row:
                row = answer_row(row, row["chosen"])
            try:
                prompt, response = render_pair(tokenizer, row)
            except RenderError as exc:
                raise FineflowError(f"{eval_file}:{line_number}: cannot render the eval row's prompt: {exc}") from None
            answer = response.find(row["output"]) if row.get("output") else -1
            prefix = response[:answer] if answer >= 0 else ""
            fh.write(json.dumps({**row, "prompt": prompt, "response_prefix": prefix}, ensure_ascii=False) + "\n")
    return out


def _registry_mentions(names: set[str]) -> set[str]:
    """The names that occur literally in some YAML of lm-eval's built-in task folders.

    Every registered task, group and tag name is written in one of those files, so a name found nowhere
    is certainly not there: reading the files' text (~1 s) spares a misspelt name lm-eval's full index.
    """
    import lm_eval.tasks

    left, found = set(names), set()
    for path in Path(lm_eval.tasks.__file__).parent.rglob("*.yaml"):
        text = path.read_text(encoding="utf-8", errors="replace")
        hits = {name for name in left if name in text}
        found |= hits
        left -= hits
        if not left:
            break
    return found


def resolve_tasks(tasks: list[str], bundled_dir: Path, task_dirs: list[str]):
    """(lm-eval TaskManager that knows every name in tasks, the names that come from lm-eval's registry)."""
    from lm_eval.tasks import TaskManager

    missing = [d for d in task_dirs if not Path(d).is_dir()]
    if missing:
        raise FineflowError(
            f"params.yaml: evaluate.task_dirs names folder(s) that do not exist: {missing} "
            f"(relative paths are read from {Path.cwd()})"
        )
    paths = [str(bundled_dir), *(str(Path(d).resolve()) for d in task_dirs)]  # later paths win on a clash
    local = TaskManager(include_path=paths, include_defaults=False)
    outside = [t for t in tasks if t not in local.all_tasks]
    if not outside:
        return local, []
    maybe_registry = _registry_mentions(set(outside))
    manager = TaskManager(include_path=paths, include_defaults=True) if maybe_registry else local
    unknown = [t for t in outside if t not in manager.all_tasks]
    if unknown:
        hint = (
            " (a YAML lm-eval cannot parse is skipped silently: check the files under evaluate.task_dirs)"
            if task_dirs
            else ""
        )
        raise FineflowError(
            f"params.yaml: evaluate.tasks names unknown task(s) {unknown}: neither bundled, nor "
            f"in evaluate.task_dirs {task_dirs}, nor in lm-eval's registry{hint}; available "
            f"locally: {sorted(local.all_tasks)}"
        )
    return manager, outside


def _offline() -> bool:
    return any(
        os.environ.get(key, "0").strip().lower() not in ("", "0", "false", "no", "off")
        for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )


def _build_error(manager, name: str, from_registry: bool, exc: Exception) -> str:
    text = str(exc).strip()
    detail = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    entry = manager.task_index.get(name)
    if not from_registry:
        where = f" ({entry.yaml_path})" if entry is not None and entry.yaml_path else ""
        return f"params.yaml: evaluate.tasks: task {name!r}{where} cannot be built: {detail}"
    dataset = ((entry.cfg if entry is not None else None) or {}).get("dataset_path")
    needs = f"lm-eval registry task {name!r} needs its dataset" + (f" ({dataset})" if dataset else "")
    if _offline():
        return (
            f"params.yaml: evaluate.tasks: {needs}, which is not in the local datasets cache, and "
            f"HF_DATASETS_OFFLINE is set, so it cannot be downloaded. Fetch it once with network access "
            f"(HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0), or remove {name!r} from evaluate.tasks. ({detail})"
        )
    return f"params.yaml: evaluate.tasks: {needs}, which could not be loaded: {detail}"


def check_tasks(manager, tasks: list[str], registry_tasks: list[str]) -> None:
    """Build every task once (dataset and all) before any model is loaded; a task that cannot be built is
    the user's to fix, so it raises one clear FineflowError instead of failing every model's evaluation."""
    for name in tasks:
        try:
            manager.load([name])
        except Exception as exc:  # noqa: BLE001 — lm-eval and datasets raise what they raise: name the task
            raise FineflowError(_build_error(manager, name, name in registry_tasks, exc)) from None


# ---------------------------------------------------------------- models


def find_model(path: Path | None) -> tuple[str, Path] | None:
    """("adapter" | "full", directory) for a PEFT adapter or a whole HF model at path (or in its adapter/ or
    merged/ subfolder), or None when there is nothing to evaluate there."""
    if path is None:
        return None
    for kind, folder, marker in (
        ("adapter", path, "adapter_config.json"),
        ("adapter", path / "adapter", "adapter_config.json"),
        ("full", path, "config.json"),
        ("full", path / "merged", "config.json"),
    ):
        if (folder / marker).is_file():
            return kind, folder
    return None


def champion_record(champion_dir: Path | None) -> dict:
    """The champion's champion.json ({} when there is none or it is unreadable)."""
    try:
        record = json.loads((Path(champion_dir) / CHAMPION_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return {}
    return record if isinstance(record, dict) else {}


def champion_id(champion_dir: Path) -> str | None:
    """The champion's id (its record's ``candidate_id``); None if unreadable."""
    return champion_record(champion_dir).get("candidate_id")


@dataclass(frozen=True)
class LoadPlan:
    """How the evaluate stage loads a model (fineflow.evaluate.sizing decides it): the torch dtype name, the
    device it goes to whole, or an accelerate device map that shards it (device_map: the base's placement;
    max_memory: the budget another model, a champion on another base, is placed under), and the bitsandbytes
    4-bit settings of a QLoRA base scored as trained."""

    dtype: str = "float32"
    device: str = "cpu"
    device_map: dict | None = None
    max_memory: dict | None = None
    quantization: dict | None = None

    def kwargs(self, same_as_base: bool) -> dict:
        """from_pretrained's arguments for the base (same_as_base) or for another model."""
        import torch

        out = {"dtype": getattr(torch, self.dtype)}
        if self.quantization is not None:
            from transformers import BitsAndBytesConfig

            out["quantization_config"] = BitsAndBytesConfig(**self.quantization)
            if self.max_memory is None:
                return {**out, "device_map": {"": 0}}
            # sharded 4-bit: transformers' quantizer sizes the 4-bit modules for accelerate's placement
            return {**out, "device_map": "auto", "max_memory": self.max_memory}
        if self.device_map is not None and same_as_base:
            return {**out, "device_map": self.device_map}
        if self.device_map is not None:  # another model (a champion on another base): accelerate places it alike
            return {**out, "device_map": "auto", "max_memory": self.max_memory}
        return out


PAIR_LOGPS = "fineflow_pair_logps"  # in a model's results: the pair scorer's log-probs, beside lm-eval's


class ModelScorer:
    """One loaded base model and tokenizer, scored plain, under an adapter, or beside a whole model. With a
    pair_scorer (fineflow.evaluate.pair_ranking.PairScorer), each model is also scored on the eval pairs while it is
    loaded, with the tokenizer lm-eval uses for it: its log-probs go in the results under PAIR_LOGPS."""

    def __init__(
        self,
        base: str,
        tasks: list[str],
        manager,
        batch_size: int,
        limit: int | None,
        load: LoadPlan | None = None,
        pair_scorer=None,
    ):
        self.base_source, self.tasks, self.manager = base, tasks, manager
        self.batch_size, self.limit = batch_size, limit
        self.load = load or LoadPlan()
        self.pair_scorer = pair_scorer
        self.base = self.tokenizer = None

    def _load(self, path: str | Path):
        from transformers import AutoModelForCausalLM

        kwargs = self.load.kwargs(same_as_base=str(path) == str(self.base_source))
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        if "device_map" not in kwargs:
            model = model.to(self.load.device)
        return model.eval()

    def load_base(self) -> float:
        from transformers import AutoTokenizer

        started = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_source)
        self.base = self._load(self.base_source)
        return time.perf_counter() - started

    def score(self, kind: str, path: Path | None = None) -> tuple[dict, float, float]:
        """(lm-eval results, load seconds, scoring seconds) for kind "base", "adapter" (path on the loaded
        base, not merged), "full" (the whole model at path, freed afterwards) or "adapter_on_base" (path: an
        adapter dir and the other base it wraps)."""
        if kind == "base":
            return self._timed(self._loaded_base(), 0.0)
        started = time.perf_counter()
        if kind in ("full", "adapter_on_base"):  # another whole model: the base makes room (reloaded if needed)
            self.base = None
            self._free()
        if kind == "adapter_on_base":  # path: (adapter dir, its own base): a champion without merged/ on another base
            return self._adapter_on_its_base(*path, started)
        if kind == "full":  # its own tokenizer when it has one (a champion merged on another base)
            model = self._load(path)
            tokenizer = self._own_tokenizer(path)
            try:
                return self._timed(model, time.perf_counter() - started, tokenizer)
            finally:
                del model
                self._free()
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(self._loaded_base(), str(path), is_trainable=False).eval()
        except Exception:
            self._restore_base()
            raise
        try:
            return self._timed(model, time.perf_counter() - started)
        finally:
            self.base = model.unload()  # LoRA layers swapped back for the originals: the next adapter won't stack
            del model
            self._free()

    def _loaded_base(self):
        """The base, loaded again if a whole model took its place (the evaluation's plan holds one model at a time:
        a 70B base beside a 70B fine-tune or merged champion would be twice the weights)."""
        if self.base is None:
            self.base = self._load(self.base_source)
        return self.base

    def _adapter_on_its_base(self, adapter: Path, base_ref: str, started: float) -> tuple[dict, float, float]:
        """An adapter scored on the base it was trained on (loaded in place of this run's, freed afterwards), with the
        tokenizer stored beside it when there is one, else its base's."""
        from peft import PeftModel
        from transformers import AutoTokenizer

        model = PeftModel.from_pretrained(self._load(base_ref), str(adapter), is_trainable=False).eval()
        tokenizer = self._own_tokenizer(adapter) or AutoTokenizer.from_pretrained(base_ref)
        try:
            return self._timed(model, time.perf_counter() - started, tokenizer)
        finally:
            del model
            self._free()

    def _timed(self, model, load_s: float, tokenizer=None) -> tuple[dict, float, float]:
        tokenizer = tokenizer or self.tokenizer
        results, score_s = evaluate_model(model, tokenizer, self.tasks, self.manager, self.batch_size, self.limit)
        if self.pair_scorer is not None:
            started = time.perf_counter()
            results[PAIR_LOGPS] = self.pair_scorer(model, tokenizer)
            score_s += time.perf_counter() - started
        return results, load_s, score_s

    def _own_tokenizer(self, path: Path):
        from transformers import AutoTokenizer

        has_one = any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
        return AutoTokenizer.from_pretrained(path) if has_one else None

    def _restore_base(self) -> None:
        """A failed adapter load can leave LoRA layers injected into the base: reload it clean."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        if any(isinstance(module, BaseTunerLayer) for module in self.base.modules()):
            self.base = None
            self._free()
            self.base = self._load(self.base_source)

    def _free(self) -> None:
        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def evaluate_model(
    model, tokenizer, tasks: list[str], manager, batch_size: int, limit: int | None
) -> tuple[dict, float]:
    """Run lm-eval on an in-memory model; returns (results dict, seconds spent scoring).

    Memory stays flat in the number of docs: HFLM runs ``batch_size`` requests at a time and keeps of each
    only its reduced answer — the generated string, or for a log-likelihood request (each option of a
    multiple-choice doc) a (sum of log-probs, is_greedy) pair; a batch's logits are freed with the batch.
    ``log_samples`` then holds per doc those answers plus the doc and prompt text, never logits.
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    started = time.perf_counter()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    results = simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        limit=limit,
        log_samples=True,
        bootstrap_iters=0,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
    )
    return results, time.perf_counter() - started


# ---------------------------------------------------------------- results


def _sample(row: dict, config: dict, metric_names: dict) -> dict:
    """One doc's scores: doc_id, target and prediction as text, and each metric's value for this doc."""
    resps = row["filtered_resps"]
    out = {"doc_id": row["doc_id"], "target": row["target"], "prediction": resps[0] if resps else None}
    if config.get("output_type") == "multiple_choice":
        # the continuation scored: the task's delimiter, the row's response prefix (bundled tasks), the option
        delimiter = config.get("target_delimiter", " ") + ((row.get("doc") or {}).get("response_prefix") or "")
        options = [args[1].removeprefix(delimiter) for args in row["arguments"]]
        lls = [float(r[0]) for r in resps]
        best = max(range(len(lls)), key=lls.__getitem__) if lls else None
        target = row["target"]
        out.update(
            target=options[target] if isinstance(target, int) and 0 <= target < len(options) else target,
            prediction=options[best] if best is not None else None,
            loglikelihoods=lls,
        )
    return {**out, **{m: row[m] for m in metric_names if m in row}}


def summarize(results: dict) -> tuple[dict, dict]:
    """(metrics per task, per-sample scores per task) from an lm-eval results dict."""
    metrics: dict[str, dict[str, float]] = {}
    for task, values in results["results"].items():
        metrics[task] = {
            key.split(",")[0]: float(v)
            for key, v in values.items()
            if "," in key and "_stderr" not in key and isinstance(v, (int, float))
        }
    configs = results.get("configs") or {}
    samples = {
        task: [_sample(r, configs.get(task) or {}, metrics.get(task, {})) for r in rows]
        for task, rows in (results.get("samples") or {}).items()
    }
    return metrics, samples


def write_samples(folder: Path, results: dict) -> None:
    """lm-eval's logged samples as they are, one ``<task>.jsonl`` per task (one doc per line)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for task, rows in (results.get("samples") or {}).items():
        with (folder / f"{task}.jsonl").open("w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, default=str, ensure_ascii=False) + "\n")


def results_file(results: dict) -> dict:
    """The standard lm-eval results JSON (what lm-eval's own results file holds: no per-sample logs)."""
    return json.loads(json.dumps({k: v for k, v in results.items() if k != "samples"}, default=str))
