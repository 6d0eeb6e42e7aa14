"""Two ranks on two "hosts": Linux network namespaces on this machine, joined by a veth pair,
each rank with its own hostname (a UTS namespace) and address, so torch.distributed talks TCP
between them and the same-host shared-memory all-reduce switches itself off. Runs GptSession with
tensor parallelism 2 and with pipeline parallelism 2 across the two, and compares the greedy,
beam and seeded-sampling tokens with one process.

    sudo python -m samples.two_hosts            # needs root (ip netns, unshare); prints one line per world

Everything it makes (two namespaces `bm2h-<pid>-a/b`, the veth pair inside them, addresses
10.213.<x>.1/.2) is removed at the end, also when a rank fails; nothing outside those namespaces
(and loopback) is used.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

MASTER_PORT = 29641   # inside the fresh namespace: its own port space


class NamespacesUnavailable(RuntimeError):
    """This machine (or user) cannot make network namespaces."""


class TwoHosts:
    """Two network namespaces joined by a veth pair: `a` at 10.213.x.1, `b` at 10.213.x.2."""

    def __init__(self):
        self.tag = f"bm2h-{os.getpid() % 100000}"
        self.names = (f"{self.tag}-a", f"{self.tag}-b")
        self.addresses = (f"10.213.{os.getpid() % 250}.1", f"10.213.{os.getpid() % 250}.2")
        self.devices = ("bmveth-a", "bmveth-b")
        self._made: list[str] = []

    def __enter__(self) -> TwoHosts:
        for tool in ("ip", "unshare"):
            if shutil.which(tool) is None:
                raise NamespacesUnavailable(f"`{tool}` is not installed")
        try:
            for name in self.names:
                _run("ip", "netns", "add", name)
                self._made.append(name)
            a, b = self.names
            _run("ip", "netns", "exec", a, "ip", "link", "add", self.devices[0], "type", "veth", "peer", "name",
                 self.devices[1], "netns", b)
            for name, device, address in zip(self.names, self.devices, self.addresses):
                _run("ip", "netns", "exec", name, "ip", "addr", "add", f"{address}/24", "dev", device)
                _run("ip", "netns", "exec", name, "ip", "link", "set", device, "up")
                _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.__exit__()
            raise NamespacesUnavailable(f"{' '.join(e.cmd)}: {e.stderr.strip() or e}") from None
        return self

    def __exit__(self, *exc) -> None:
        for name in self._made:   # deleting a namespace deletes the veth end inside it (and its peer)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
        self._made = []

    def launch(self, host: int, rank: int, env: dict[str, str], args: list[str],
               module: tuple[str, ...] = ("samples.two_hosts", "rank")) -> subprocess.Popen:
        """`python -m MODULE ARGS` (default: this script's rank) as `rank` in namespace `host`,
        hostname <tag>-host-<host>."""
        command = ["ip", "netns", "exec", self.names[host], "unshare", "--uts", "sh", "-c",
                   f"hostname {self.tag}-host-{host} && exec \"$@\"", "sh",
                   sys.executable, "-m", *module, *args]
        environment = {**os.environ, **env, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": self.addresses[0], "MASTER_PORT": str(MASTER_PORT),
                       "GLOO_SOCKET_IFNAME": self.devices[host], "OMP_NUM_THREADS": "1"}
        return subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def _prompts_and_samplings():
    from runtime import SamplingConfig
    prompts = [[5, 9, 14, 3, 7], [11, 2, 60]]
    return prompts, [SamplingConfig(), SamplingConfig(beam_width=2), SamplingConfig(top_k=5, random_seed=7)]


def generate(checkpoint: str, world) -> tuple[list[list], bool]:
    """(every sampling's output ids (GptSession) as nested lists, whether the shared-memory all-reduce is on)."""
    import torch

    from runtime import Engine, GenerationInput, GenerationOutput, GptSession
    engine = Engine.from_dir(checkpoint)
    session = GptSession(GptSession.Config(2, 2, 32), engine.model_config, world, engine)
    prompts, samplings = _prompts_and_samplings()
    results = []
    for sampling in samplings:
        inputs = GenerationInput(end_id=-1, pad_id=0, ids=torch.tensor([p + [0] * (5 - len(p)) for p in prompts]),
                                 lengths=torch.tensor([len(p) for p in prompts]), packed=False, max_new_tokens=6)
        output = GenerationOutput()
        session.generate(output, inputs, sampling)
        results.append(output.ids.tolist())
    tp = session.tensor_parallel
    return results, (tp is not None and tp.shared is not None)


def rank_main(checkpoint: str, mode: str) -> None:
    import socket

    from runtime import WorldConfig
    world = WorldConfig(tensor_parallelism=2) if mode == "tp" else WorldConfig(tensor_parallelism=1,
                                                                               pipeline_parallelism=2)
    import torch.distributed as dist
    results, shared_memory = generate(checkpoint, world)
    print(json.dumps({"host": socket.gethostname(), "results": results, "shared_memory": shared_memory}),
          flush=True)
    dist.barrier()                 # neither rank leaves while the other still talks to it
    dist.destroy_process_group()


def run_two_hosts(checkpoint: str, mode: str, timeout_s: float = 300) -> list[dict]:
    """Both ranks' reports (rank order) for `mode` ("tp" or "pp") across two fresh namespaces."""
    with TwoHosts() as hosts:
        ranks = [hosts.launch(host, host, {"BATCH_MANAGER_DIST_TIMEOUT_S": "60"}, [checkpoint, mode])
                 for host in (0, 1)]
        deadline = time.monotonic() + timeout_s
        reports = []
        for rank, process in enumerate(ranks):
            try:
                out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in ranks:
                    p.kill()
                raise RuntimeError(f"rank {rank} did not finish in {timeout_s:g} s") from None
            if process.returncode != 0:
                for p in ranks:
                    p.kill()
                raise RuntimeError(f"rank {rank} failed (exit {process.returncode}):\n{err[-4000:]}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
        return reports


def write_checkpoint(directory: str) -> str:
    from samples.default_model import write_random_llama
    return write_random_llama(directory, seed=3, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                              max_position_embeddings=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    rank = sub.add_parser("rank", help="(internal) one rank, started inside a namespace")
    rank.add_argument("checkpoint")
    rank.add_argument("mode", choices=["tp", "pp"])
    args = parser.parse_args()
    if args.command == "rank":
        rank_main(args.checkpoint, args.mode)
        return
    from runtime import WorldConfig
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_checkpoint(os.path.join(tmp, "model"))
        expected, _ = generate(checkpoint, WorldConfig())
        for mode in ("tp", "pp"):
            start = time.monotonic()
            reports = run_two_hosts(checkpoint, mode)
            same = all(r["results"] == expected for r in reports)
            print(f"{mode.upper()}=2 across hosts {[r['host'] for r in reports]}: tokens equal to one process: "
                  f"{same}; shared-memory all-reduce: {[r['shared_memory'] for r in reports]}; "
                  f"{time.monotonic() - start:.1f} s")
            if not same:
                sys.exit(1)


if __name__ == "__main__":
    main()
