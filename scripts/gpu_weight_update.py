"""Weight updates on the GPU at production widths: the updated engine serves a fresh engine's bits.

    python3 scripts/gpu_weight_update.py --w0 /tmp/rl_llama --work /tmp/wu

W0 is an HF checkpoint (scripts/gpu_run.sh's rl_loop_prod builds a Llama-3-8B-width 2-layer one);
W1 is W0 with every weight moved by a seeded N(0, 0.002^2) step, made on CUDA by torch and saved.
One rl-bitwise engine starts from W0 with a warm prefix cache, then is updated to W1
(1) in process from the CUDA tensors (DLPack, no host copy), (2) back to W0 and to W1 again from
disk. After each, a 1100-token teacher-forced sequence and 16 greedy tokens after a 1024-token
prompt (ids and logprob bits) must equal those of a fresh engine started from W1, and differ from
W0's (the control). Prints a table; exit 0 iff every row holds.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAUNCH = dict(numerics="rl-bitwise", skip_warmup=True, max_total_tokens=16384,
              chunked_prefill_size=512, max_prefill_tokens=2048)


def fingerprint(eng, vocab: int) -> tuple:
    rng = np.random.default_rng(7)
    seq = rng.integers(0, vocab, 1100).tolist()
    tf = eng.generate(input_ids=seq, return_logprob=True, logprob_start_len=0,
                      sampling_params={"max_new_tokens": 0})
    greedy = eng.generate(input_ids=seq[:1024], return_logprob=True, logprob_start_len=1000,
                          sampling_params={"max_new_tokens": 16, "temperature": 0,
                                           "ignore_eos": True})
    lps = [e[0] for e in tf["meta_info"]["input_token_logprobs"][1:]]
    lps += [e[0] for e in greedy["meta_info"]["input_token_logprobs"]]
    lps += [e[0] for e in greedy["meta_info"]["output_token_logprobs"]]
    bits = np.asarray(lps, np.float32).view(np.uint32)
    return tuple(greedy["output_ids"]), bits.tobytes(), greedy["meta_info"]["weight_version"]


def make_w1(w0: Path, w1: Path, device: str):
    import torch

    from interop.trainer_dump import load_hf_model

    model = load_hf_model(w0, device=device)
    g = torch.Generator(device=device).manual_seed(11)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
                   .mul_(0.002).to(p.dtype))
    model.save_pretrained(w1)
    for f in w0.iterdir():  # tokenizer and generation config, as W0 has them
        if f.is_file() and not (w1 / f.name).exists():
            shutil.copy(f, w1 / f.name)
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--w0", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--device", default="cuda", help="where the trainer's W1 tensors live")
    args = ap.parse_args()
    from jengine import Engine

    w0, w1 = Path(args.w0), Path(args.work) / "w1"
    w1.mkdir(parents=True, exist_ok=True)
    model = make_w1(w0, w1, args.device)
    rows, ok = [], True
    with Engine(model_path=str(w1), **LAUNCH) as fresh:
        vocab = fresh.model_config.vocab_size
        want = fingerprint(fresh, vocab)
    with Engine(model_path=str(w0), **LAUNCH) as eng:
        old = fingerprint(eng, vocab)  # also warms the prefix cache with W0's KV
        control = old[:2] != want[:2]
        rows.append(("W0 (control: must differ from W1)", control, "-"))
        ok &= control
        for how in ("tensors", "disk"):
            t0 = time.perf_counter()
            if how == "tensors":
                r = eng.update_weights_from_tensor(dict(model.state_dict()), weight_version="w1")
            else:
                eng.update_weights_from_disk(str(w0), weight_version="w0")
                eng.generate(input_ids=list(range(1, 300)), sampling_params={"max_new_tokens": 1})
                r = eng.update_weights_from_disk(str(w1), weight_version="w1")
            seconds = time.perf_counter() - t0
            got = fingerprint(eng, vocab)
            same = r.get("success") and got[:2] == want[:2] and got[2] == "w1"
            rows.append((f"updated W0 -> W1 from {how}", same, f"{seconds:.1f} s"))
            ok &= bool(same)
    print("| case | equals a fresh W1 engine (ids + logprob bits) | update time |")
    print("|---|---|---|")
    for name, verdict, secs in rows:
        print(f"| {name} | {verdict} | {secs} |")
    print("weight update on the GPU:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
