"""The chunked linear cross-entropy (fineflow.objectives.token_loss): the same loss and gradients as the plain path
(alone,
through a LoRA model's forward, through the training loop), the plain path where it does not apply, and a peak
memory on CPU that drops as logits_peak_bytes says."""

import json
import subprocess
import sys

import pytest
import torch

from fineflow.objectives import token_loss as chunked
from fineflow.objectives.token_loss import token_loss_sum
from tests.conftest import venv_env


def _plain_and_chunked(hidden, weight, targets, chunk_tokens):
    results = []
    for compute in (
        lambda h, w: chunked.plain_cross_entropy(h @ w.t(), targets),
        lambda h, w: chunked.chunked_cross_entropy(h, w, targets, chunk_tokens),
    ):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        value = compute(h, w)
        (value * 0.5).backward()  # a gradient other than 1 reaches the loss, as the loop's scaling does
        results.append((value.detach(), h.grad, w.grad))
    return results


@pytest.mark.parametrize("chunk_tokens", [1, 8, 37, 100])
def test_chunked_loss_and_gradients_equal_the_plain_path(chunk_tokens):
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(37, 16, generator=generator), torch.randn(50, 16, generator=generator)
    targets = torch.randint(0, 50, (37,), generator=generator)
    (loss, grad_h, grad_w), (c_loss, c_grad_h, c_grad_w) = _plain_and_chunked(hidden, weight, targets, chunk_tokens)
    torch.testing.assert_close(c_loss, loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(c_grad_h, grad_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c_grad_w, grad_w, rtol=1e-5, atol=1e-6)


def test_a_frozen_head_gets_no_gradient_and_no_grad_mode_keeps_none():
    hidden, weight = torch.randn(9, 8, requires_grad=True), torch.randn(20, 8)
    targets = torch.randint(0, 20, (9,))
    chunked.chunked_cross_entropy(hidden, weight, targets, 4).backward()
    assert hidden.grad is not None and weight.grad is None
    with torch.no_grad():
        value = chunked.chunked_cross_entropy(hidden, weight, targets, 4)
    assert not value.requires_grad
    torch.testing.assert_close(value, chunked.plain_cross_entropy(hidden.detach() @ weight.t(), targets))


@pytest.fixture
def chunks(monkeypatch) -> list:
    """One entry per chunk the chunked path projects (the test sees that it ran)."""
    calls = []
    real_chunk = chunked._chunk_loss_and_grads
    monkeypatch.setattr(chunked, "_chunk_loss_and_grads", lambda *a: calls.append(1) or real_chunk(*a))
    return calls


def _tiny_llama(lora: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0))


def _packed_batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (2, 40), generator=generator)
    labels = torch.where(torch.rand(2, 40, generator=generator) < 0.5, ids, -100)  # half the tokens trained
    positions = torch.cat([torch.arange(25), torch.arange(15)]).repeat(2, 1)  # two examples per row
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_the_model_forward_gives_the_plain_loss_and_gradients_chunk_by_chunk(lora, chunks):
    """Through the (peft-wrapped) model's own forward: the same loss and the same gradient of every trainable
    parameter (LoRA's, or every weight with the head's); the chunked path ran, chunk by chunk."""
    batch = _packed_batch()
    results = []
    for chunk_tokens in (0, 7):
        model = _tiny_llama(lora)
        value, count = token_loss_sum(model, batch, loss_chunk_tokens=chunk_tokens)
        value.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
        results.append((value.detach(), count, grads))
    (loss, count, grads), (c_loss, c_count, c_grads) = results
    assert count == c_count == int((batch["labels"][:, 1:] != -100).sum()) and len(chunks) == -(-count // 7)
    torch.testing.assert_close(c_loss, loss, rtol=1e-6, atol=1e-5)
    assert grads.keys() == c_grads.keys() and (lora or "lm_head.weight" in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(c_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_micro_batch_within_one_chunk_and_heads_it_does_not_cover_take_the_plain_path():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = _tiny_llama(lora=False)
    wrapped = torch.nn.Module()
    wrapped.module = model  # as DDP and DeepSpeed's engine hold it
    assert chunked.output_head(wrapped) is model.lm_head
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(96))
    assert chunked.output_head(model) is None  # a bias the chunked maths leaves out
    gemma2 = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, final_logit_softcapping=30.0,
        )
    )  # fmt: skip
    assert chunked.output_head(gemma2) is None  # the forward soft-caps the logits after the head
    logits, _ = token_loss_sum(_tiny_llama(lora=False), _packed_batch(), loss_chunk_tokens=1000)
    assert logits.grad_fn.name() != "ChunkedLinearCrossEntropyBackward"  # fewer trained tokens than a chunk


MEASURE = """
import json, sys
import torch
from fineflow.objectives import token_loss as chunked


def rss(field):  # bytes, from /proc/self/status (VmRSS: now; VmHWM: the peak since the last reset)
    line = next(line for line in open("/proc/self/status") if line.startswith(field))
    return int(line.split()[1]) * 1024


tokens, vocab, dim, chunk = (int(a) for a in sys.argv[1:])
hidden = torch.randn(tokens, dim, requires_grad=True)
weight, targets = torch.randn(vocab, dim) * 0.02, torch.randint(0, vocab, (tokens,))
open("/proc/self/clear_refs", "w").write("5")  # the peak restarts from what is resident now (Linux >= 4.0)
before = rss("VmRSS:")
if chunk:
    value = chunked.chunked_cross_entropy(hidden, weight, targets, chunk)
else:
    value = chunked.plain_cross_entropy(hidden @ weight.t(), targets)
value.backward()
print(json.dumps(rss("VmHWM:") - before))
"""


@pytest.mark.slow
def test_peak_memory_on_cpu_drops_as_logits_peak_bytes_says(tmp_path):
    """Forward and backward in a fresh process each, peak RSS over what was resident before the loss: the plain
    path holds the whole (4,096 x 16,384) logits (256 MiB in fp32), the chunked one 256-token slices of them."""
    tokens, vocab, dim, chunk = 4096, 16384, 64, 256
    peaks = {}
    for chunk_tokens in (0, chunk):
        done = subprocess.run(
            [sys.executable, "-c", MEASURE, str(tokens), str(vocab), str(dim), str(chunk_tokens)],
            # a fixed mmap threshold: glibc would otherwise raise it to the first freed chunk's size and serve the
            # next chunks from a heap that keeps freed pages resident, so the peak would depend on the order of frees
            env={**venv_env(), "MALLOC_MMAP_THRESHOLD_": "65536"},
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        peaks[chunk_tokens] = json.loads(done.stdout.strip().splitlines()[-1])
    logits_bytes = tokens * vocab * 4
    plain_said = chunked.logits_peak_bytes(tokens, vocab, 0, compute_bytes=4)
    chunked_said = chunked.logits_peak_bytes(tokens, vocab, chunk, compute_bytes=4)
    assert peaks[0] >= logits_bytes  # the logits existed whole
    # + the hidden states' gradients, and the allocator's slack (one more chunk-sized temporary: measured 60-77 MB
    # against 50 MB said for the chunk's three copies)
    assert peaks[chunk] <= chunked_said + 2 * tokens * dim * 4 + 32 * 2**20
    assert peaks[0] - peaks[chunk] >= (plain_said - chunked_said) / 2


def test_training_with_chunked_logits_takes_the_plain_paths_steps(built, tmp_path, chunks):
    """train.loss_chunk_tokens reaches the loop (training and evaluation): a run chunked 16 trained tokens at a
    time logs the same per-step losses and evaluation loss as the plain run (0) on the same batches."""
    from tests.test_train_engine import _params, _train

    runs = {}
    for chunk_tokens in (0, 16):
        (tmp_path / str(chunk_tokens)).mkdir()
        params = _params(steps=3, tracker="none", eval_every=3, loss_chunk_tokens=chunk_tokens)
        report = _train(built, tmp_path / str(chunk_tokens), params)
        steps = (tmp_path / str(chunk_tokens) / "steps.jsonl").read_text().splitlines()
        runs[chunk_tokens] = report, [json.loads(line)["loss"] for line in steps]
        assert bool(chunks) == bool(chunk_tokens)
    (plain, plain_losses), (chunky, chunked_losses) = runs[0], runs[16]
    assert chunked_losses == pytest.approx(plain_losses, rel=1e-4)
    assert plain["eval_loss"] is not None and chunky["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-4)


def test_under_ddp_every_trainable_weight_gets_the_plain_gradient_step_after_step(tmp_path, chunks):
    """DDP wraps the model (gloo, one rank): the chunked head runs inside DDP's forward, so its reducer sees every
    trainable parameter's gradient, the head's included (full fine-tuning), on consecutive steps (a parameter
    without one fails the second), and they equal the unwrapped plain path's."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        batch, reference = _packed_batch(), _tiny_llama(lora=False)
        token_loss_sum(reference, batch)[0].backward()
        ddp = DistributedDataParallel(_tiny_llama(lora=False))
        for _ in range(2):
            ddp.zero_grad()
            token_loss_sum(ddp, batch, loss_chunk_tokens=5)[0].backward()
        assert len(chunks) == 2 * -(-int((batch["labels"][:, 1:] != -100).sum()) // 5)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(ddp.module.get_parameter(name).grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        dist.destroy_process_group()


def test_the_shipped_params_train_the_embedded_model_on_the_plain_path():
    """The default run's micro-batch never holds more trained tokens than one chunk: it keeps the plain path's
    exact arithmetic, so its adapter stays byte-identical to the one before chunking existed."""
    from pathlib import Path

    from fineflow.core.config import load_params

    params = load_params(Path(__file__).parents[1] / "params.yaml")
    trained_at_most = params.train.micro_batch_size * (params.tokenize.seq_len - 1)
    assert 0 < trained_at_most <= params.train.loss_chunk_tokens
