"""`jengine generate`: one offline completion, printed to stdout.

    jengine generate --model tiny --prompt "Hello" --max-new-tokens 16
    jengine generate --model DIR --chat --prompt "What is 2+2?" --temperature 1 --sampling-seed 7
    jengine generate --input-ids 1,2,3 --max-new-tokens 4 --json      # the whole output dict

Every launch option of `jengine serve` is accepted (same LaunchConfig). Sampling defaults to greedy
here (temperature 0), unlike the API's SGLang default of 1.0: an offline check wants a fixed answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jengine.config import add_launch_arguments, launch_config_from_args


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate a completion offline and print it",
                              description=__doc__.splitlines()[0])
    g = p.add_argument_group("request")
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--input-ids", help="prompt as comma-separated token ids (instead of --prompt)")
    g.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the "
                   "model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="request seed (default: crc32 of the request id)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--return-logprob", action="store_true", help="include logprobs (with --json)")
    g.add_argument("--json", action="store_true", help="print the full output dict(s) as JSON")
    add_launch_arguments(p)
    return p


def _request_inputs(args: argparse.Namespace, tokenizer) -> list[int]:
    if (args.prompt is None) == (args.input_ids is None):
        raise ValueError("pass exactly one of --prompt or --input-ids")
    if args.input_ids is not None:
        try:
            return [int(t) for t in args.input_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--input-ids={args.input_ids!r} must be comma-separated integers") from None
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(text)


def main(args: argparse.Namespace) -> int:
    cfg = launch_config_from_args(args)
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from jengine.engine.engine import Engine

    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
                "seed": args.sampling_seed, "stop": args.stop, "ignore_eos": args.ignore_eos,
                "n": args.n}
    with Engine.from_config(cfg) as engine:
        try:
            input_ids = _request_inputs(args, engine.tokenizer)
            out = engine.generate(input_ids=input_ids, sampling_params=sampling,
                                  return_logprob=args.return_logprob)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    outs = out if isinstance(out, list) else [out]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for o in outs:
            print(o["text"])
    return 1 if any(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs) else 0
