"""The tuner's report (docs/tune.md, "Report"): JSON, and a PNG of predicted
vs measured cost (matplotlib, from the `bench` extra: without it the PNG is
skipped with a message saying so)."""
from __future__ import annotations

import json
import sys
from typing import Any

from detent.tune_search import TuneResult

FORMAT = "detent-tune-report/1"


def report_dict(res: TuneResult, *, meta: dict[str, Any], profile: dict[str, Any], unit: str,
                objective: str, kernel_buckets: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    fams = {}
    for name, r in res.families.items():
        fams[name] = {
            "legal_assignments": r.legal,
            "measured_assignments": sum("same_as" not in t for t in r.tried),
            "default": r.default,
            "chosen": r.chosen,
            "chosen_cost": r.cost(r.chosen),
            "inert_axes": r.inert,
            "tried": [{"assignment": t["assignment"], "costs": {f"{f:g}": c for f, c in sorted(t["costs"].items())},
                       **({"same_as": t["same_as"]} if "same_as" in t else {})} for t in r.tried],
        }
    return {
        "format": FORMAT, **meta, "objective": objective, "unit": unit,
        "tuple_hash": res.chosen.hash,
        "kept_default": res.kept_default,
        "default_cost": res.base_cost,
        "default_costs_first_last": list(res.base_costs),
        "search_pick": res.pick,
        "predicted_cost": res.base_cost if res.pick_predicted is None else res.pick_predicted,
        "measured_cost": res.base_cost if res.pick_cost is None else res.pick_cost,
        "additivity": {"delta": res.delta, "checks": res.checks},
        "confirmed": res.confirmed,
        "search_cut": res.cut,
        "families": fams,
        "kernel_buckets": kernel_buckets,
        "profile": profile,
    }


def write_report(path: str, report: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, sort_keys=False, default=str)
        f.write("\n")


def write_plot(path: str, report: dict[str, Any]) -> bool:
    """Predicted vs measured cost of every tuple measured on the whole workload
    (single-family repins lie on the diagonal by construction; the mixes test additivity)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("detent tune: matplotlib is not installed, no plot written (pip install 'detent[bench]')",
              file=sys.stderr)
        return False
    base = report["default_cost"]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for fam, r in report["families"].items():
        xs = [t["costs"]["1"] for t in r["tried"] if "1" in t["costs"]]
        ax.scatter(xs, xs, s=14, alpha=0.6, label=f"{fam} (one family repinned)")
    checks = report["additivity"]["checks"]
    ax.scatter([c["predicted"] for c in checks], [c["measured"] for c in checks], marker="x", s=60, c="k",
               label="mixes of families (additivity check)")
    ax.scatter([base], [base], marker="*", s=140, c="tab:red", label="default tuple")
    lo = min([base] + [c["measured"] for c in checks] + [c["predicted"] for c in checks]
             + [t["costs"]["1"] for r in report["families"].values() for t in r["tried"] if "1" in t["costs"]])
    hi = max([base] + [c["measured"] for c in checks] + [c["predicted"] for c in checks]
             + [t["costs"]["1"] for r in report["families"].values() for t in r["tried"] if "1" in t["costs"]])
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xlabel(f"predicted ({report['unit']})")
    ax.set_ylabel(f"measured ({report['unit']})")
    ax.set_title(f"{report.get('workload', '')}: additivity delta {100 * report['additivity']['delta']:.2f}%")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
