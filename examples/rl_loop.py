"""An on-policy RL loop with jengine as the rollout engine: the train/rollout logprob gap is 0.0.

    python examples/rl_loop.py                    # a tiny random Qwen3 checkpoint, 3 steps, CPU
    python examples/rl_loop.py --model DIR --device cuda --steps 3 --max-request-bytes 4294967296

One step is the loop RL frameworks (slime, verl, AReaL) run around SGLang, reduced to its bones:

1. rollout: `POST /generate` to a real `jengine serve --numerics rl-bitwise` process: --group
   samples per prompt at T=1, seeded, each with its tokens' logprobs;
2. score: the trainer -- HF transformers' own model under `interop.trainer_mode` -- teacher-forces
   the same tokens and takes their logprobs with its blockwise cross-entropy
   (`interop.trainer_logprobs.token_logprobs`). Printed: max |train - rollout| over every sampled
   token, and how many of them differ in any bit. The same tokens scored by stock torch (no trainer
   mode) are printed beside it: the negative control, which must differ;
3. learn: REINFORCE with a per-prompt mean baseline on a toy reward (the share of sampled ids in the
   lower half of the vocabulary), one SGD step. The logprobs the loss differentiates are the very
   ones compared in 2 (trainer mode has a backward: docs/interop.md);
4. sync: the new weights go back with `POST /update_weights_from_tensor` (safetensors bytes,
   base64, in buckets under the server's --max-request-bytes), the last bucket naming the
   `weight_version`; the server flushes its prefix cache. The next rollout reports that version.

Exit status 0 iff every step's trainer-mode gap is exactly 0.0 with every bit equal, and stock
torch differs on some step (docs/rl.md).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def post(url: str, path: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def rollout(url: str, prompts: list[list[int]], *, group: int, seed: int, max_new_tokens: int):
    """[(prompt, output ids, output logprobs f32, weight_version)], `group` per prompt."""
    outs = post(url, "/generate", {
        "input_ids": prompts, "return_logprob": True,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "n": group,
                            "seed": seed, "ignore_eos": True}})
    samples = []
    for i, out in enumerate(outs):  # n outputs per prompt, prompt order
        meta = out["meta_info"]
        logprobs = np.asarray([e[0] for e in meta["output_token_logprobs"]], np.float32)
        samples.append((prompts[i // group], out["output_ids"], logprobs, meta["weight_version"]))
    return samples


def trainer_logprobs(model, prompt, output, *, trainer_mode_on: bool):
    """The trainer's logprobs of `output` after `prompt`, differentiable, f32[len(output)]."""
    import torch

    from interop import trainer_mode
    from interop.trainer_logprobs import token_logprobs

    device = next(model.parameters()).device
    ids = torch.tensor(list(prompt) + list(output), device=device)
    if trainer_mode_on:
        with trainer_mode.enable(model):
            logits = model(ids[None], use_cache=False).logits[0]
            lp = token_logprobs(logits[:-1], ids[1:], form="neg-ce")
    else:  # stock torch: what an unmodified trainer computes
        logits = model(ids[None], use_cache=False).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
    return lp[len(prompt) - 1:]


def gap(train, rollout_lp: np.ndarray) -> tuple[float, int]:
    """(max |train - rollout|, tokens whose f32 bits differ: -0.0 and +0.0 count as different)."""
    t = train.detach().float().cpu().numpy()
    return float(np.max(np.abs(t.astype(np.float64) - rollout_lp))), int(
        np.count_nonzero(t.view(np.uint32) != rollout_lp.view(np.uint32)))


def push_weights(url: str, model, version: str, bucket_bytes: int) -> int:
    """The model's tensors in safetensors buckets of at most `bucket_bytes` (one tensor larger than
    that goes alone); the last bucket names the weight version. Returns the number of requests."""
    from safetensors.torch import save

    buckets, current, size = [], {}, 0
    for name, t in model.state_dict().items():
        t = t.detach().contiguous().cpu()
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = {}, 0
        current[name] = t
        size += n
    buckets.append(current)
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        r = post(url, "/update_weights_from_tensor", {
            "serialized_named_tensors": [base64.b64encode(save(bucket)).decode()],
            "weight_version": version if last else None})
        if not r.get("success"):
            raise RuntimeError(f"weight update refused: {r}")
    return len(buckets)


def reward(output: list[int], vocab: int) -> float:
    return float(np.mean(np.asarray(output) < vocab // 2))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an HF checkpoint dir (default: a tiny random Qwen3 one)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=2, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--device", default="cpu", help="the trainer's torch device")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20,
                   help="the server's request-size limit; weight buckets stay under 3/4 of it")
    p.add_argument("--server-arg", action="append", default=[], help="extra `jengine serve` args")
    args = p.parse_args(argv)

    import torch

    from interop.testing import make_tiny_hf_model
    from interop.trainer_dump import load_hf_model
    from jengine.server.testing import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(make_tiny_hf_model(Path(tmp) / "policy", "Qwen3ForCausalLM",
                                                         seed=0))
        model = load_hf_model(model_dir, device=args.device)
        vocab = model.config.vocab_size
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, vocab, (args.prompts, args.prompt_len)).tolist()
        server_args = ["--model", model_dir, "--numerics", "rl-bitwise", "--skip-warmup",
                       "--max-request-bytes", str(args.max_request_bytes), *args.server_arg]
        ok_bitwise, stock_differs = True, False
        print("step  version  reward  max|train-rollout|  bits-differ  stock-torch max|diff|  "
              "tensors changed  update")
        with ServerProcess(server_args) as server:
            version = post(server.url, "/generate", {"input_ids": [1], "sampling_params": {
                "max_new_tokens": 1}})["meta_info"]["weight_version"]
            for step in range(args.steps):
                samples = rollout(server.url, prompts, group=args.group, seed=1000 + step,
                                  max_new_tokens=args.max_new_tokens)
                assert all(s[3] == version for s in samples), "rollout served by an old version"
                losses, worst, differing, stock_worst = [], 0.0, 0, 0.0
                rewards = np.asarray([reward(out, vocab) for _, out, _, _ in samples])
                baseline = rewards.reshape(args.prompts, args.group).mean(1).repeat(args.group)
                for (prompt, out, lp_rollout, _), adv in zip(samples, rewards - baseline):
                    lp = trainer_logprobs(model, prompt, out, trainer_mode_on=True)
                    g, d = gap(lp, lp_rollout)
                    worst, differing = max(worst, g), differing + d
                    with torch.no_grad():
                        stock = trainer_logprobs(model, prompt, out, trainer_mode_on=False)
                    stock_worst = max(stock_worst, gap(stock, lp_rollout)[0])
                    losses.append(-float(adv) * lp.sum())
                ok_bitwise &= worst == 0.0 and differing == 0
                stock_differs |= stock_worst != 0.0
                optimizer.zero_grad()
                # The backward may use any accurate arithmetic (only the forward must be bitwise):
                # outside trainer mode it runs torch's own kernels, fast.
                torch.stack(losses).mean().backward()
                before = [q.detach().clone() for q in model.parameters()]
                optimizer.step()
                changed = sum(not torch.equal(a, q) for a, q in zip(before, model.parameters()))
                del before
                t0 = time.perf_counter()
                version = f"step-{step + 1}"
                # base64 makes 4/3 of the bytes: half the limit leaves room for it and the JSON
                requests = push_weights(server.url, model, version, args.max_request_bytes // 2)
                print(f"{step:4d}  {samples[0][3]:>7}  {rewards.mean():6.3f}  {worst:18.1f}  "
                      f"{differing:11d}  {stock_worst:21.3e}  {changed:15d}  {requests} request(s), "
                      f"{time.perf_counter() - t0:.1f} s -> {version}", flush=True)
            with urllib.request.urlopen(server.url + "/get_weight_version") as r:
                served = json.loads(r.read())["weight_version"]
            assert served == version, (served, version)
    verdict = ok_bitwise and stock_differs
    print(("PASS" if verdict else "FAIL") + f": trainer mode == rollout bit for bit at every step: "
          f"{ok_bitwise}; stock torch differs: {stock_differs}")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
