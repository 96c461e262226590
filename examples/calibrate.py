"""Calibrate DIP on a corpus and print the density split it fits.

`flashlm.workflows.calibrate.calibrate` measures, on the calibration split of a corpus, the quantiles of
the MLP inputs and gate activations per layer (the thresholds of CATS and of DIP's per-layer / global
variants) and DIP's perplexity over a grid of (input density, down density) pairs, and fits the
Pareto-optimal split. The result (`calibration.json`) is written into the model's store, where every
later `FlashConfig(method="dip", density=...)` without an `input_density` picks it up, so give
`--store` to try it without changing the default store.

    python examples/calibrate.py --store /tmp/smollm2.flash      # 2048 tokens of shakespeare: minutes
    python examples/calibrate.py --store /tmp/smollm2.flash --tokens 512 --densities 0.5,0.7
"""

from argparse import ArgumentParser, RawDescriptionHelpFormatter

from flashlm.data.models import model_path
from flashlm.workflows.calibrate import calibrate


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a bundled model's name or a checkpoint directory (default: SmolLM2)")
    parser.add_argument("--store", help="store directory (default: one in flashlm's cache)")
    parser.add_argument("--memory-budget", default="50%", help="cache: '50%%' of the MLP bytes, or '64MB'")
    parser.add_argument("--corpus", default="shakespeare", help="corpus whose calibration split is used")
    parser.add_argument("--tokens", type=int, default=2048, help="calibration tokens")
    parser.add_argument("--context-length", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--densities", default="0.4,0.5,0.6,0.7,0.8,0.9", help="comma-separated")
    args = parser.parse_args()

    calibration = calibrate(
        model_path(args.model),
        corpus=args.corpus,
        store=args.store,
        memory_budget=args.memory_budget,
        num_tokens=args.tokens,
        context_length=min(args.context_length, args.tokens),
    )
    print(f"calibrated on {calibration.tokens} tokens of {calibration.corpus}")
    dense = next(p for p in calibration.split_points if p["rho_in"] == p["rho_down"] == 1)
    print(
        f"measured {len(calibration.split_points)} splits; perplexity {dense['perplexity']:.2f} at density 1"
    )
    for density in (float(text) for text in args.densities.split(",")):
        rho_in, rho_down = calibration.split(density)
        print(f"density {density:.0%}: input columns {rho_in:.1%}, down columns {rho_down:.1%}")


if __name__ == "__main__":
    main()
