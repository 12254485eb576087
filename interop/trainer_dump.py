"""`python -m interop.trainer_dump`: run an HF model as a trainer would, under trainer mode, and write a dump.

    python -m interop.trainer_dump --hf-model DIR --input seqs.jsonl --out dump.pt \\
        [--logprob-form neg-ce|direct] [--device cpu|cuda] [--record-states N] [--stock]

Each input line is one sequence: ``{"ids": [...]}`` (prompt followed by response),
``{"prompt_ids": [...], "response_ids": [...]}``, or ``{"messages": [...]}`` rendered with the
model's chat template (the last message is the response when it is the assistant's). The model is
HF transformers' own ``AutoModelForCausalLM`` in bf16, loaded from safetensors with no remote code,
run one sequence per forward under ``interop.trainer_mode.enable(model)``; logprobs use the trainer's
blockwise cross-entropy (interop/trainer_logprobs.py). ``--stock`` skips trainer mode: the dump is
then what an unmodified torch trainer computes (a negative control for ``jengine align``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jengine.logprob_orders import BLOCKWISE_VOCAB_BLOCK, LOGPROB_BLOCK_WIDTHS

logger = logging.getLogger("interop.trainer_dump")


@dataclass(frozen=True)
class InputSequence:
    ids: list[int]
    prompt_len: int | None  # where the response starts, when the input says
    where: str = ""  # "file:line", for errors


def _int_list(value: Any, where: str, field: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                              for i in value):
        raise ValueError(f"{where}: field {field!r} must be a list of non-negative ints, got "
                         f"{str(value)[:80]}")
    return value


def parse_input_line(obj: Any, where: str, tokenizer=None) -> InputSequence:
    """One JSONL record -> token ids (and the prompt length when known)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    kinds = [k for k in ("ids", "prompt_ids", "messages") if k in obj]
    if len(kinds) != 1:
        raise ValueError(f"{where}: give exactly one of 'ids', 'prompt_ids'+'response_ids', "
                         f"'messages' (got keys {sorted(obj)})")
    if kinds[0] == "ids":
        return InputSequence(_int_list(obj["ids"], where, "ids"), None)
    if kinds[0] == "prompt_ids":
        if "response_ids" not in obj:
            raise ValueError(f"{where}: field 'response_ids' is missing next to 'prompt_ids'")
        prompt = _int_list(obj["prompt_ids"], where, "prompt_ids")
        response = _int_list(obj["response_ids"], where, "response_ids")
        if not prompt or not response:
            raise ValueError(f"{where}: 'prompt_ids' and 'response_ids' must both be non-empty")
        return InputSequence(prompt + response, len(prompt))
    messages = obj["messages"]
    if tokenizer is None:
        raise ValueError(f"{where}: 'messages' needs the model's tokenizer")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: field 'messages' must be a non-empty list")
    full = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False),
                            add_special_tokens=False)
    prompt_len = None
    if messages[-1].get("role") == "assistant" and len(messages) > 1:
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True),
                                  add_special_tokens=False)
        if 0 < len(prompt) < len(full) and full[:len(prompt)] == prompt:
            prompt_len = len(prompt)
    return InputSequence(full, prompt_len)


def read_inputs(path, tokenizer=None) -> list[InputSequence]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON: {e}") from None
            seq = dataclasses.replace(parse_input_line(obj, where, tokenizer), where=where)
            if len(seq.ids) < 2:
                raise ValueError(f"{where}: a sequence needs at least 2 tokens, got {len(seq.ids)}")
            out.append(seq)
    if not out:
        raise ValueError(f"{path}: no sequences")
    return out


def check_vocabulary(inputs: list[InputSequence], vocab_size: int) -> None:
    for seq in inputs:
        bad = [(i, t) for i, t in enumerate(seq.ids) if t >= vocab_size]
        if bad:
            i, t = bad[0]
            raise ValueError(f"{seq.where}: token id {t} at position {i} is outside the model's "
                             f"vocabulary (vocab_size={vocab_size})")


def load_hf_model(directory, device: str = "cpu"):
    """HF transformers' own model class, bf16, safetensors only, no remote code."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.bfloat16, trust_remote_code=False, use_safetensors=True)
    return model.to(device).eval()


def score_sequence(model, seq: InputSequence, *, form: str, block_size: int, record_logits: int,
                   record_states: int, table=None) -> dict[str, Any]:
    """One forward over ``seq`` -> a dump record (trainer mode, if wanted, is the caller's)."""
    import torch

    from interop.states import capture_hf_states
    from interop.trainer_logprobs import token_logprobs

    device = next(model.parameters()).device
    ids = torch.tensor(seq.ids, dtype=torch.long, device=device)[None]
    n_states = min(record_states, len(seq.ids))
    with torch.no_grad():
        if n_states:
            with capture_hf_states(model, n_states) as states:
                logits = model(ids, use_cache=False).logits[0]
        else:
            states = None
            logits = model(ids, use_cache=False).logits[0]
        logprob = token_logprobs(logits[:-1], ids[0, 1:], form=form, block_size=block_size, table=table)
    record: dict[str, Any] = {"ids": ids[0].cpu(), "logprob": logprob.float().cpu()}
    if record_logits:
        record["logits"] = logits[:min(record_logits, len(seq.ids))].cpu()
    if seq.prompt_len is not None:
        record["prompt_len"] = seq.prompt_len
    if states:
        record["states"] = dict(states)
    return record


def default_commit() -> str:
    import torch
    import transformers

    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return (f"jengine-interop{'@' + sha if sha else ''} transformers {transformers.__version__} "
            f"torch {torch.__version__}")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="python -m interop.trainer_dump",
                                          description=__doc__.splitlines()[0])
    p.add_argument("--hf-model", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--input", required=True, help="JSONL, one sequence per line")
    p.add_argument("--out", required=True, help="dump file to write (.pt or .safetensors)")
    p.add_argument("--logprob-form", default="neg-ce", choices=("neg-ce", "direct"),
                   help="neg-ce: -(lse - target), -0.0 for a certain token (engine --logprob-order "
                        "blockwise); direct: target - lse (blockwise-direct)")
    p.add_argument("--block-size", type=int, default=BLOCKWISE_VOCAB_BLOCK, choices=LOGPROB_BLOCK_WIDTHS,
                   help="vocab shard width of the trainer's log-softmax fold")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--record-logits", type=int, default=8, help="store logits of the first N "
                   "positions (0 = none, at most 8)")
    p.add_argument("--record-states", type=int, default=0, help="store named intermediate states "
                   "of the first N positions for `jengine align --bisect` (0 = none)")
    p.add_argument("--layout", default=None, help="trainer layout string (default: TP1 PP1 EP1 bf16 ...)")
    p.add_argument("--commit", default=None, help="trainer commit string (default: this checkout)")
    p.add_argument("--stock", action="store_true", help="do NOT enable trainer mode (negative control)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from interop import trainer_mode
    from interop.dumps import write_dump
    from jengine.models.tokenizer import Tokenizer

    if not 0 <= args.record_logits <= 8:
        raise SystemExit(f"--record-logits={args.record_logits} must be in [0, 8]")
    trainer_mode.ensure_xla_environment()  # before JAX starts: the engine's XLA flags
    tokenizer = None
    if (Path(args.hf_model) / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_dir(args.hf_model)
    inputs = read_inputs(args.input, tokenizer)
    model = load_hf_model(args.hf_model, args.device)
    check_vocabulary(inputs, model.config.vocab_size)
    layout = args.layout or (f"TP1 PP1 EP1 bf16 {args.device} "
                             f"{'stock-torch' if args.stock else 'jengine-trainer-mode'}")
    commit = args.commit or default_commit()
    mode = None if args.stock else trainer_mode.enable(model, device=args.device)
    records = []
    try:
        for i, seq in enumerate(inputs):
            rec = score_sequence(model, seq, form=args.logprob_form, block_size=args.block_size,
                                 record_logits=args.record_logits, record_states=args.record_states)
            records.append({**rec, "layout": layout, "commit": commit})
            logger.info("sequence %d: %d tokens", i, len(seq.ids))
    finally:
        if mode is not None:
            summary = mode.summary()
            trainer_mode.disable()
            logger.info("%s", summary)
            if mode.fallbacks:
                logger.warning("WARNING: some ops ran torch's own kernels (fallbacks above): those "
                               "values are torch's, not the engine's")
    write_dump(args.out, records)
    from interop.trainer_logprobs import logprob_order_for

    print(f"wrote {len(records)} sequences to {args.out}; align with: jengine align --model "
          f"{args.hf_model} --dump {args.out} --numerics rl-bitwise --logprob-order "
          f"{logprob_order_for(args.logprob_form, args.block_size)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ModuleNotFoundError as e:
        from jengine.cli import TORCH_SIDE, torch_side_message

        if e.name not in TORCH_SIDE:
            raise
        print(torch_side_message("python -m interop.trainer_dump", e.name), file=sys.stderr)
        sys.exit(2)
