"""Share of repeated prefixes routed to the node that holds them: Dynamo's KV router vs round-robin.

For each router mode a fresh `dualpace cluster up --nodes 2 --router-mode MODE` runs (real
processes on 127.0.0.1, prefix caching on). The same sequence of completions goes through the
frontend, one at a time: each of --num-prefixes long prefixes once (its holder is the node that
served it), then --num-repeats requests that repeat a prefix with a new ending, in a fixed
shuffled order. Which node served each request is read from the nodes' routers
(dualpace_requests_total before and after). Reports per mode: requests per node, the share of
repeats served by the prefix's holder, and for kv Dynamo's own router hit rate. Writes
bench/results/dynamo_prefix_routing_<tag>.json.

    python -m bench.dynamo_prefix_routing --model ./tiny-llama --tag tiny-llama
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from toolkit.processes import Daemon

READY = re.compile(r"dualpace cluster: ready; \d+ nodes behind (\S+)/v1 \(model (\S+);")
NODE = re.compile(r"dualpace cluster: node (\d+): router \S+ \(http (\S+)\)")
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
START_TIMEOUT_S = 600.0
SETTLE_S = 1.0  # after the first round, for the stored events to reach the frontend


class Cluster:
    def __init__(self, model: str, mode: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dualpace", "cluster", "up", "--nodes", "2", "--model", model,
             "--http-port", "0", "--router-mode", mode],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.nodes: dict[int, str] = {}
        self.url = self.model = None
        ready = threading.Event()

        def pump() -> None:
            for line in self.process.stdout:
                if match := NODE.search(line):
                    self.nodes[int(match.group(1))] = match.group(2)
                elif match := READY.search(line):
                    self.url, self.model = match.group(1), match.group(2)
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(START_TIMEOUT_S) or self.url is None:
            self.stop()
            raise RuntimeError(f"dualpace cluster up --router-mode {mode} did not get ready")

    def served(self) -> list[float]:
        counts = []
        for index in sorted(self.nodes):
            text = _get(f"http://{self.nodes[index]}/metrics")
            counts.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                              if line.startswith("dualpace_requests_total{")))
        return counts

    def complete(self, prompt: str, max_tokens: int) -> int:
        """The index of the node that served it."""
        before = self.served()
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        request = urllib.request.Request(f"{self.url}/v1/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as reply:
            json.loads(reply.read())
        deltas = [after - was for after, was in zip(self.served(), before)]
        return deltas.index(max(deltas))

    def frontend_sum(self, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in _get(f"{self.url}/metrics").splitlines()
                   if line.startswith(name + "{"))

    def stop(self) -> None:
        Daemon(self.process, self.url or "").stop(timeout_s=120.0)  # SIGTERM: cluster up stops all it started


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


def run_mode(args: argparse.Namespace, mode: str, order: list[int]) -> dict:
    prefixes = [" ".join(WORDS[i:] + WORDS[:i]) * args.prefix_repeats for i in range(args.num_prefixes)]
    cluster = Cluster(args.model, mode)
    try:
        holder = [cluster.complete(p + " start", args.max_tokens) for p in prefixes]
        time.sleep(SETTLE_S)
        rate_before = (cluster.frontend_sum("dynamo_component_router_kv_hit_rate_sum"),
                       cluster.frontend_sum("dynamo_component_router_kv_hit_rate_count"))
        landed = [cluster.complete(f"{prefixes[p]} again {n}", args.max_tokens) for n, p in enumerate(order)]
        rate_sum = cluster.frontend_sum("dynamo_component_router_kv_hit_rate_sum") - rate_before[0]
        rate_count = cluster.frontend_sum("dynamo_component_router_kv_hit_rate_count") - rate_before[1]
    finally:
        cluster.stop()
    hits = sum(node == holder[p] for node, p in zip(landed, order))
    result = {"mode": mode, "holders": holder, "landed": landed, "num_repeats": len(order),
              "num_on_holder": hits, "share_on_holder": round(hits / len(order), 3),
              "requests_per_node": [(holder + landed).count(i) for i in (0, 1)],
              "dynamo_router_kv_hit_rate": round(rate_sum / rate_count, 3) if rate_count else None}
    print(f"{mode}: {hits}/{len(order)} repeats on the prefix's holder; requests per node "
          f"{result['requests_per_node']}; Dynamo router hit rate {result['dynamo_router_kv_hit_rate']}",
          file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model for `dualpace cluster up` (a Hugging Face folder)")
    p.add_argument("--modes", default="kv,round-robin")
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--prefix-repeats", type=int, default=2, help="the word list repeated this often per prefix")
    p.add_argument("--num-repeats", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="run")
    args = p.parse_args(argv)
    if not 1 <= args.num_prefixes <= len(WORDS) or args.num_repeats < 1:
        p.error(f"--num-prefixes must be in 1..{len(WORDS)} and --num-repeats >= 1")
    order = [i % args.num_prefixes for i in range(args.num_repeats)]
    random.Random(args.seed).shuffle(order)
    results = [run_mode(args, mode, order) for mode in args.modes.split(",")]
    load = os.getloadavg()
    out = {"model": Path(args.model).name, "order": order, "results": results, "loadavg_after": [round(x, 2) for x in load]}
    path = Path(__file__).parent / "results" / f"dynamo_prefix_routing_{args.tag}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path} (load average {load[0]:.1f})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
