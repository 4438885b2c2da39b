"""vLLM parity: the champion's LoRA adapter, laid out by the export stage for vLLM, served by vLLM, against the model
the gate evaluated (transformers + peft), greedy, on the eval docs; the vLLM half of issue 35's parity check, for
the GPU acceptance run (vLLM's CUDA wheel) or vLLM's CPU wheel where it runs (a separate environment).

    .venv/bin/python bench/vllm_parity.py --champion models/champion --eval-rows data/validated/eval.jsonl \
        --vllm-python /path/to/vllm-env/bin/python [--limit 32] [--max-tokens 16] [--out vllm_parity.json]

The adapter goes through ``fineflow.export.vllm.write_vllm_layout`` (its files, the --max-lora-rank it computes,
and the problems it reports refuse the run), each eval conversation is rendered by the training tokenizer's chat
template (generation prompt on), and both sides get the same prompt token ids: vLLM's ``LLM.generate`` with a
``LoRARequest`` (temperature 0) in a subprocess of --vllm-python, transformers + peft's ``generate`` (greedy) here.
Printed side by side: the share of docs whose answer tokens are identical, and each side's exact match on the eval
targets with the gate's paired bootstrap (``fineflow.export.parity.check_scores``, tolerance 0.01: the f16 rule).
The embedded model cannot run in vLLM's CPU wheel (no attention kernel for its head size of 16): use a real base.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# runs in --vllm-python: reads {"base", "adapter", "rank", "prompts", "max_tokens"} on stdin, prints the answers' ids
VLLM_SIDE = """
import json, sys
def main():
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    longest = max(len(p) for p in job["prompts"]) + job["max_tokens"]
    llm = LLM(model=job["base"], enable_lora=True, max_lora_rank=job["rank"], max_loras=1, dtype=job["dtype"],
              max_model_len=longest, enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    outputs = llm.generate(prompts, params, lora_request=LoRARequest("champion", 1, job["adapter"]))
    print("VLLM_ANSWERS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
if __name__ == "__main__":
    main()
"""


def eval_prompts(tokenizer, eval_rows: Path, work: Path, limit: int) -> tuple[list[list[int]], list[str]]:
    """Each eval conversation as the chat template renders it for a reply, tokenized; and its target."""
    from fineflow.export.trained import rendered_eval_docs

    docs = rendered_eval_docs(eval_rows, tokenizer, work, limit)
    prompts = []
    for doc in docs:
        turns = doc.conversation[:-1] if doc.conversation[-1]["role"] == "assistant" else doc.conversation
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts, [doc.target for doc in docs]


def torch_answers(base: str, champion: Path, prompts: list[list[int]], max_tokens: int, eos: list[int]):
    """transformers + peft, greedy: the model the gate evaluated."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fineflow.export.parity import greedy_ids

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(champion))
    return greedy_ids(model.eval(), prompts, max_tokens, eos, eos[0])


def vllm_answers(python: str, job: dict) -> list[list[int]]:
    done = subprocess.run([python, "-c", VLLM_SIDE], input=json.dumps(job), capture_output=True, text=True)
    line = next((out for out in done.stdout.splitlines() if out.startswith("VLLM_ANSWERS ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(line.removeprefix("VLLM_ANSWERS "))


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from fineflow.export.parity import EvalDoc, check_scores, cut_answer, trained_stop_ids
    from fineflow.export.vllm import write_vllm_layout
    from fineflow.registry.install import read_champion

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--champion", type=Path, default=Path("models/champion"))
    parser.add_argument("--eval-rows", type=Path, default=Path("data/validated/eval.jsonl"))
    parser.add_argument("--vllm-python", default=sys.executable, help="a Python with vLLM installed")
    parser.add_argument("--limit", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=Path("vllm_parity.json"))
    args = parser.parse_args(argv)

    base = read_champion(args.champion)["base_model"]
    with tempfile.TemporaryDirectory(prefix="vllm-parity-") as scratch:
        layout = write_vllm_layout(args.champion, Path(scratch))
        if layout["problems"] or not layout["adapter"]:
            raise SystemExit(f"vLLM would refuse this champion: {layout['problems'] or 'no adapter'}")
        rank = int(layout["commands"]["lora"].rsplit("--max-lora-rank", 1)[1].split()[0])
        tokenizer = AutoTokenizer.from_pretrained(base)
        prompts, targets = eval_prompts(tokenizer, args.eval_rows, Path(scratch) / "work", args.limit)
        eos = trained_stop_ids(tokenizer, None)
        job = {
            "base": base,
            "adapter": str(Path(scratch) / layout["adapter"]),
            "rank": rank,
            "prompts": prompts,
            "max_tokens": args.max_tokens,
            "dtype": args.dtype,
        }
        served = vllm_answers(args.vllm_python, job)
    evaluated = torch_answers(base, args.champion, prompts, args.max_tokens, eos)
    served = [ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))] for ids in served]
    evaluated = [ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))] for ids in evaluated]
    text = lambda ids: cut_answer(tokenizer.decode(ids, skip_special_tokens=True))  # noqa: E731
    docs = [EvalDoc("", "", target, []) for target in targets]
    bootstrap = {"samples": 2000, "confidence": 0.95, "seed": 0}
    scores = check_scores([text(a) for a in served], [text(a) for a in evaluated], docs, 0.01, bootstrap)
    result = {
        "base": base,
        "docs": len(prompts),
        "max_lora_rank": rank,
        "identical_tokens": sum(a == b for a, b in zip(served, evaluated)) / len(prompts),
        "scores": scores.figures,
        "passed": scores.passed,
        "reason": scores.reason,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"{'side':<22}{'exact match':>12}")
    print(f"{'transformers + peft':<22}{scores.figures['reference_exact_match']:>12.3f}")
    print(f"{'vLLM (LoRA)':<22}{scores.figures['exact_match']:>12.3f}")
    print(
        f"identical answer tokens {result['identical_tokens']:.3f} of {len(prompts)} docs; "
        f"difference {scores.figures['delta']:+.3f} CI {scores.figures['ci']}: {'pass' if scores.passed else 'FAIL'}"
    )
    return 0 if scores.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
