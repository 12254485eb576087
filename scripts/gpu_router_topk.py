"""The ("moe", "router_topk") torch leaf against live torch.topk on CUDA, byte for byte.

    python scripts/gpu_router_topk.py [--device cuda|cpu] [--out DIR]

PyTorch does not document topk's tie order, so the leaf's claim (PyTorch CUDA's `topk(sorted=True)`
order, pallas_kernels/moe_router.py) is checked against the live kernel. For every expert count E in
{8, 64, 128, 160, 256} and k in {1, 2, 4, 6, 8, 12, 16, 32, 33, 50, 64} (k <= E), on random,
all-tied, cutoff-tied (ties straddling the k-th place) and near-tied (one ulp apart) router logits
and the measured patterns below (MEASURED_CUDA_PATTERNS):

  order    (fatal) P = torch.softmax(x.float(), -1) on the GPU; torch.topk(P, k, sorted=True) ==
           the leaf's top-k (`torch_cuda_topk`, JAX on the GPU) on the same P: ids equal, values'
           bits equal. This is the tie order itself, independent of how the softmax rounds.
  packing  (fatal) each row alone == the same row inside a batch of 1000 shuffled rows, for torch
           and for the leaf.
  leaf     (reported) the whole leaf (`router_topk_torch`: the engine's fixed-order fp32 softmax,
           then the top-k) vs torch.topk(torch.softmax(x.float(), -1)): ids and weight bits agree
           only where the two softmaxes round alike; trainer mode runs the leaf's twin in the
           router, so engine and trainer agree by construction, not through this row.

`--device cpu` runs the leaf on the CPU and checks it against MEASURED_CUDA_PATTERNS (torch CUDA's
output measured on the H200, reference-notes 5.1) and, on rows without ties, against a plain sort;
not against CPU torch, whose tie order differs (TopKImpl.h: partial_sort / nth_element). Prints the
torch version and a table; exits 1 on any fatal mismatch. Writes router_topk.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.moe_router import router_topk_torch, torch_cuda_topk  # noqa: E402

EXPERTS = (8, 64, 128, 160, 256)
KS = (1, 2, 4, 6, 8, 12, 16, 32, 33, 50, 64)
PACKED_ROWS = 1000

# torch.topk(row, k, sorted=True) on CUDA (H200, reference-notes 5.1) for a row that is 1.0 at the
# tied ids and 0.0 elsewhere: (name, row length, tied ids, k, the returned ids).
_ALL_32 = [31, 30, 28, 29, 25, 24, 26, 27, 19, 18, 16, 17, 21, 20, 22, 23,
           7, 6, 4, 5, 1, 0, 2, 3, 11, 10, 8, 9, 13, 12, 14, 15]
_TEN_TIES = (3, 50, 77, 90, 120, 130, 140, 150, 160, 170)
MEASURED_CUDA_PATTERNS = (
    ("all-equal k=8", 32, tuple(range(32)), 8, [7, 6, 4, 5, 1, 0, 2, 3]),
    ("all-equal k=12", 32, tuple(range(32)), 12, [7, 6, 4, 5, 1, 0, 2, 3, 11, 10, 8, 9]),
    ("all-equal k=32", 32, tuple(range(32)), 32, _ALL_32),
    ("{5,9} k=2", 16, (5, 9), 2, [9, 5]),
    ("10-tie set k=8", 200, _TEN_TIES, 8, [150, 140, 120, 130, 50, 3, 77, 90]),
    ("all-equal k=33 (ascending)", 64, tuple(range(64)), 33, list(range(33))),
    ("all-equal k=64 (ascending)", 64, tuple(range(64)), 64, list(range(64))),
)


def pattern_row(n: int, tied) -> np.ndarray:
    row = np.zeros(n, np.float32)
    row[list(tied)] = 1.0
    return row


def case_logits(e: int, k: int, rng) -> dict[str, np.ndarray]:
    """Router logits [rows, e] per input kind."""
    random = (rng.standard_normal((16, e)) * 2).astype(np.float32)
    cutoff = (rng.standard_normal((8, e)) * 2).astype(np.float32)
    for r, row in enumerate(cutoff):  # ranks k-1-a .. k-1+b share the k-th largest logit
        order = np.argsort(-row, kind="stable")
        lo, hi = max(0, k - 1 - r % 3), min(e, k + 1 + r % 4)
        row[order[lo:hi]] = row[order[k - 1]]
    near = (rng.standard_normal((8, e)) * 2).astype(np.float32)
    for r, row in enumerate(near):  # the k-th and (k+1)-th (or a top pair) one ulp apart
        order = np.argsort(-row, kind="stable")
        a, b = (order[k - 1], order[min(k, e - 1)]) if r % 2 == 0 else (order[0], order[1])
        row[b] = np.nextafter(row[a], np.float32(-np.inf) if r % 4 < 2 else np.float32(np.inf))
    tied = np.zeros((2, e), np.float32)
    tied[1] = 0.5
    return {"random": random, "cutoff-tied": cutoff, "near-tied": near, "all-tied": tied}


_TOPK = jax.jit(torch_cuda_topk, static_argnums=1)
_LEAF = jax.jit(router_topk_torch, static_argnames=("k", "norm_topk_prob"))


def jax_topk(probs: np.ndarray, k: int):
    values, ids = _TOPK(jnp.asarray(probs), k)
    return np.asarray(ids).astype(np.int64), np.asarray(values)


def jax_leaf(logits: np.ndarray, k: int):
    ids, weights = _LEAF(jnp.asarray(logits), k=k, norm_topk_prob=False)
    return np.asarray(ids).astype(np.int64), np.asarray(weights)


def mismatched_rows(a, b) -> int:
    """Rows whose ids differ or whose values' bits differ."""
    (ia, va), (ib, vb) = a, b
    return int(np.count_nonzero((ia != ib).any(-1) | (va.view(np.uint32) != vb.view(np.uint32)).any(-1)))


def packed(fn, rows: np.ndarray, k: int, rng):
    """fn on `rows` inside a shuffled batch of PACKED_ROWS rows, results in `rows`' order."""
    filler = (rng.standard_normal((PACKED_ROWS - len(rows), rows.shape[1])) * 2).astype(np.float32)
    batch = np.concatenate([rows, filler])
    perm = rng.permutation(PACKED_ROWS)
    ids, vals = fn(batch[perm], k)
    back = np.argsort(perm)[:len(rows)]
    return ids[back], vals[back]


def alone(fn, rows: np.ndarray, k: int):
    out = [fn(rows[i:i + 1], k) for i in range(len(rows))]
    return np.concatenate([o[0] for o in out]), np.concatenate([o[1] for o in out])


def check_patterns() -> list[str]:
    failures = []
    for name, n, tied, k, want in MEASURED_CUDA_PATTERNS:
        ids, _ = jax_topk(pattern_row(n, tied)[None], k)
        if ids[0].tolist() != want:
            failures.append(f"pattern {name}: leaf {ids[0].tolist()}, CUDA measured {want}")
    return failures


def run_cuda(rng) -> tuple[list[dict], list[str]]:
    import torch

    def torch_topk(probs: np.ndarray, k: int):
        values, ids = torch.topk(torch.from_numpy(probs).cuda(), k, dim=-1, sorted=True)
        return ids.cpu().numpy(), values.cpu().numpy()

    def torch_probs(logits: np.ndarray) -> np.ndarray:
        return torch.softmax(torch.from_numpy(logits).cuda().float(), -1).cpu().numpy()

    def torch_router(logits: np.ndarray, k: int):
        return torch_topk(torch_probs(logits), k)

    failures, table = [], []
    for name, n, tied, k, want in MEASURED_CUDA_PATTERNS:  # the measured table, live
        got = torch_topk(pattern_row(n, tied)[None], k)[0][0].tolist()
        if got != want:
            failures.append(f"live torch differs from the recorded pattern {name}: {got} vs {want}")
    for e in EXPERTS:
        for k in (k for k in KS if k <= e):
            cases = case_logits(e, k, rng)
            rows = np.concatenate(list(cases.values()))
            probs = torch_probs(rows)
            order = mismatched_rows(torch_topk(probs, k), jax_topk(probs, k))
            pack = (mismatched_rows(alone(torch_router, rows, k), packed(torch_router, rows, k, rng))
                    + mismatched_rows(alone(jax_leaf, rows, k), packed(jax_leaf, rows, k, rng)))
            t_ids, t_w = torch_router(rows, k)
            l_ids, l_w = jax_leaf(rows, k)
            row = {"E": e, "k": k, "rows": len(rows), "order_mismatch": order, "packing_mismatch": pack,
                   "leaf_ids_equal": float((t_ids == l_ids).all(-1).mean()),
                   "leaf_weight_bits_equal": float((t_w.view(np.uint32) == l_w.view(np.uint32)).all(-1).mean())}
            table.append(row)
            print(row, flush=True)  # progress: each (E, k) compiles its programs anew
            if order or pack:
                failures.append(f"E={e} k={k}: {order} rows differ from torch.topk, {pack} rows "
                                f"change when packed")
    return table, failures


def run_cpu(rng) -> tuple[list[dict], list[str]]:
    failures, table = [], []
    for e in EXPERTS:
        for k in (k for k in KS if k <= e):
            rows = (rng.standard_normal((16, e)) * 2).astype(np.float32)
            probs = np.asarray(jax.nn.softmax(jnp.asarray(rows)))
            ids, vals = jax_topk(probs, k)
            distinct = np.array([len(set(p.tolist())) == e for p in probs])
            want = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
            order = int(np.count_nonzero((ids != want).any(-1) & distinct))
            cases = np.concatenate(list(case_logits(e, k, rng).values()))
            pack = mismatched_rows(alone(jax_leaf, cases, k), packed(jax_leaf, cases, k, rng))
            table.append({"E": e, "k": k, "rows": len(rows) + len(cases), "order_mismatch": order,
                          "packing_mismatch": pack})
            if order or pack:
                failures.append(f"E={e} k={k}: {order} untied rows out of order, {pack} rows change "
                                f"when packed")
    return table, failures


def main() -> int:
    global EXPERTS, KS  # the grid run_cuda / run_cpu walk, narrowed by --experts / --ks
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--experts", type=int, nargs="+", default=None,
                    help=f"expert counts to check (default {EXPERTS}); each (E, k) compiles anew")
    ap.add_argument("--ks", type=int, nargs="+", default=None, help=f"k values (default {KS})")
    args = ap.parse_args()
    EXPERTS, KS = tuple(args.experts or EXPERTS), tuple(args.ks or KS)
    import torch

    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (CUDA patterns only)"
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), jax {jax.__version__} on "
          f"{jax.default_backend()}, device: {where}")
    rng = np.random.default_rng(0)
    failures = check_patterns()
    table, more = (run_cuda if args.device == "cuda" else run_cpu)(rng)
    failures += more
    cols = list(table[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in table:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    print("\n".join(failures) or "PASS: every row matches")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "router_topk.json"), "w") as f:
            json.dump({"torch": torch.__version__, "cuda": torch.version.cuda, "device": where,
                       "table": table, "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
