"""CUDA-graph capture and replay against plain execution, for the GPU tests.

``replay_both_ways`` runs one expert layer for six steps (new inputs and routing each step, ``out``
donated) in two fresh processes, one with XLA command buffers on for custom calls and one with
them off, and returns both stacks of results and the kernel launch counts each process saw. Fresh
processes, so that each kernel's first use (with its one-time setup) happens under capture. This
file is also the script those processes run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

COMMAND_BUFFER_FLAGS = {
    "graphs": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
    "plain": "--xla_gpu_enable_command_buffer=",
}


def replay_both_ways(tmp_path: Path, *, scheme: str, classes: tuple[str, ...], e: int, h: int, i: int, k: int,
                     m: int, seed: int, extra_ids: int, w_scale: tuple[float, float], counter: str | None = None,
                     cpu: bool = False) -> tuple[dict[str, np.ndarray], dict[str, int | None]]:
    """Results {"graphs", "plain"}: [steps * len(classes), m, h] float32; launches: the value of the
    CUDA library's ``counter`` at the end of each run (None without a counter). Routing: k distinct
    ids per token among e + extra_ids (ids >= e belong to no local expert). ``cpu`` runs both on the
    CPU backend (a stand-in that checks the harness itself)."""
    config = dict(scheme=scheme, classes=list(classes), e=e, h=h, i=i, k=k, m=m, seed=seed, extra_ids=extra_ids,
                  w_scale=list(w_scale), counter=counter)
    results, launches = {}, {}
    for name, flags in COMMAND_BUFFER_FLAGS.items():
        env = dict(os.environ, XLA_FLAGS=flags)
        if cpu:
            env["JAX_PLATFORMS"] = "cpu"
        path = tmp_path / f"{name}.npy"
        proc = subprocess.run([sys.executable, __file__, str(path), json.dumps(config)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[name] = np.load(path)
        launches[name] = json.loads(proc.stdout.strip().splitlines()[-1])["launches"]
    return results, launches


def _run(path: str, config: dict[str, Any]) -> None:
    import jax
    import jax.numpy as jnp

    import humming_jax as hj
    from humming_jax import experts

    assert hj.cuda_available() or jax.devices()[0].platform == "cpu", hj._ffi.backend_report()
    c = config
    counter = hj._ffi.launch_counter(c["counter"]) if c["counter"] else None
    rng = np.random.default_rng(c["seed"])
    e, h, i, k, m = c["e"], c["h"], c["i"], c["k"], c["m"]
    w = hj.quantize_moe_weights(rng.standard_normal((e, 2 * i, h)) / c["w_scale"][0],
                                rng.standard_normal((e, h, i)) / c["w_scale"][1], c["scheme"])
    results = []
    for name in c["classes"]:
        cls = getattr(experts, name)
        f = jax.jit(lambda o, x, w, tw, ids, cls=cls: cls().apply(o, x, w, tw, ids), donate_argnums=0)
        out = jnp.full((m, h), jnp.nan, jnp.bfloat16)
        for _ in range(6):
            x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
            ids = jnp.asarray(np.argsort(rng.random((m, e + c["extra_ids"])), axis=1)[:, :k].astype(np.int32))
            tw = jnp.asarray(rng.random((m, k)).astype(np.float32))
            out = f(out, x, w, tw, ids)
            results.append(np.asarray(out.astype(jnp.float32)))
    np.save(path, np.stack(results))
    print(json.dumps({"launches": int(counter()) if counter else None}))


if __name__ == "__main__":
    _run(sys.argv[1], json.loads(sys.argv[2]))
