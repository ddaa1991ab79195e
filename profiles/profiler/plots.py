"""PNG plots of a profile: one figure, one panel per table family."""

from __future__ import annotations

from pathlib import Path

from dualpace.profile.cost_model import CostModel, DecodeBatch
from dualpace.profile.schema import Profile


def plot_profile(profile: Profile, path: Path, dpi: int = 80) -> Path | None:
    """Write `path` (PNG); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cost = CostModel(profile)
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    hw, model = profile.hardware, profile.model
    fig.suptitle(f"{(profile.profiler or {}).get('model', model.architecture)} {model.dtype} on {hw.cpu_model}, "
                 f"{hw.cpu_cores} cores, {hw.cpu_threads} threads, GPU engine on {hw.device}", fontsize=10)

    ax = axes[0][0]
    t = profile.table1d("gpu_prefill_ms")
    ax.plot(t.grid, t.ms, "o-")
    ax.set(title="GPU engine prefill", xlabel="prompt tokens", ylabel="ms")

    for ax, name, title in ((axes[0][1], "gpu_decode_ms", "GPU engine decode iteration"),
                            (axes[0][2], "cpu_attention_ms", "CPU attention (all layers)")):
        t2 = profile.table2d(name)
        for i, b in enumerate(t2.grid0):
            ax.plot(t2.grid1, t2.ms[i], "o-", label=f"batch {b:g}")
        ax.set(title=title, xlabel="context tokens", ylabel="ms")
        ax.legend(fontsize=7)

    ax = axes[1][0]
    for name, label in (("cpu_dense_ms", "CPU dense (Local)"), ("lm_head_sampling_ms", "CPU LM head + sampling"),
                        ("assist_ms", "Dense Assist (total)"), ("gpu_dense_ms", "GPU dense + LM head"),
                        ("assist_round_trip_ms", "assist round trips")):
        if name in profile.tables:
            t = profile.table1d(name)
            ax.plot(t.grid, t.ms, "o-", label=label)
    ax.set(title="per-iteration components", xlabel="batch", ylabel="ms", xscale="log")
    ax.legend(fontsize=7)

    ax = axes[1][1]
    batches = profile.table1d("cpu_dense_ms").grid
    context = profile.table2d("cpu_attention_ms").grid1
    mid = context[len(context) // 2]
    local = [cost.cpu_local_ms(DecodeBatch(int(b), mid)) for b in batches]
    assisted = [cost.cpu_assisted_ms(DecodeBatch(int(b), mid)) for b in batches]
    ax.plot(batches, local, "o-", label="Local")
    ax.plot(batches, assisted, "s-", label="Assisted")
    ax.set(title=f"CPU engine iteration, predicted (context {mid:g})", xlabel="batch", ylabel="ms", xscale="log")
    ax.legend(fontsize=7)

    ax = axes[1][2]
    points = (profile.profiler or {}).get("kv_transfer_fit_points") or []
    if points:
        ax.plot([p[0] / 1e6 for p in points], [p[1] for p in points], "o", label="measured (median)")
    top = max((p[0] for p in points), default=1e7)
    xs = [0, top]
    rate, fixed = profile.kv_transfer.bytes_per_s, profile.kv_transfer.fixed_ms
    ax.plot([x / 1e6 for x in xs], [fixed + 1000 * x / rate for x in xs], "-",
            label=f"fit: {fixed:.1f} ms + bytes / {rate / 1e9:.2f} GB/s")
    ax.set(title="KV transfer (default path)", xlabel="MB", ylabel="ms")
    ax.legend(fontsize=7)

    for row in axes:
        for ax in row:
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    _shrink(path)
    return path


def _shrink(path: Path, colors: int = 64) -> None:
    """A palette PNG: line plots need few colours, and the file is committed."""
    try:
        from PIL import Image

        with Image.open(path) as image:
            small = image.convert("RGB").quantize(colors=colors)
        small.save(path, optimize=True)
    except Exception:  # noqa: BLE001, S110 - the full-colour plot is fine too
        pass
