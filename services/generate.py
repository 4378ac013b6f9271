"""`baton generate`: offline generation with the engine, text in and text out."""

from __future__ import annotations

import argparse

from baton.services.worker.config import add_engine_options, engine_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("generation")
    g.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeat for a batch)"
    )
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest (<= 0: all)")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampler")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end tokens")
    add_engine_options(parser)


def run(args: argparse.Namespace) -> int:
    from baton.common.engine.engine import Engine
    from baton.common.sampling import SamplingParams
    from baton.common.tokenizer import Tokenizer

    cfg = engine_config(args, "both")
    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        print(f"error: {e}")
        return 2
    tok = Tokenizer.load(cfg.model_path)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else tok.encode(p)
        for p in args.prompt
    ]
    options = {k: v for k, v in vars(cfg).items() if k != "model_path"}
    with Engine(cfg.model_path, **options) as engine:
        for text, out in zip(args.prompt, engine.generate(prompts, params), strict=True):
            print(f"--- {text!r} ({out.finish_reason}, {len(out.output_ids)} tokens)")
            print(tok.decode(out.output_ids))
    return 0
