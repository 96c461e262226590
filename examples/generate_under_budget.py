"""Generate text with a model whose MLPs stream from an SSD store through a cache of half their size.

Shows the main door: `AutoModelForCausalLM.from_pretrained(path, quantization_config=FlashConfig(...))`,
a greedy `model.generate`, then `flashlm.stats(model)`: MB read from the store per token and the
cache's hit rate. The store is converted from the checkpoint on first use.

    python examples/generate_under_budget.py                        # SmolLM2-135M-Instruct
    python examples/generate_under_budget.py --memory-budget 25% --new-tokens 64
    python examples/generate_under_budget.py --model qwen2.5-1.5b   # or a checkpoint directory
"""

from argparse import ArgumentParser, RawDescriptionHelpFormatter

from transformers import AutoModelForCausalLM, AutoTokenizer

import flashlm
from flashlm.data.models import model_path


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a bundled model's name or a checkpoint directory (default: SmolLM2)")
    parser.add_argument("--store", help="store directory (default: one in flashlm's cache)")
    parser.add_argument("--memory-budget", default="50%", help="cache: '50%%' of the MLP bytes, or '64MB'")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = flashlm.FlashConfig(memory_budget=args.memory_budget, store=args.store)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)

    inputs = tokenizer(args.prompt, return_tensors="pt")
    flashlm.stats(model, reset=True)  # count only what generate reads
    out = model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False)
    print(tokenizer.decode(out[0], skip_special_tokens=True))

    stats = flashlm.stats(model)
    decode = stats.totals(decode_only=True)  # per generated token, the prompt's prefill step left out
    print(
        f"stats: {decode['bytes_read_per_step'] / 1e6:.2f} MB read per token, "
        f"hit rate {decode['hit_rate']:.1%}, cache {stats.resident_bytes / 1e6:.1f} MB "
        f"of a {stats.budget_bytes / 1e6:.1f} MB budget"
    )
    print(stats.summary())


if __name__ == "__main__":
    main()
