"""The SP-vs-one-process experiment with its ranks spread over two daemons,
linked on loopback (each a node): the same bounds as on one daemon."""
import os
import sys

import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "client", "examples"))
import spclient  # noqa: E402
import train_tiny_sp as T  # noqa: E402


def test_sp_across_two_daemons():
    binary = os.environ.get("SPD_BIN", os.path.join(ROOT, "build", "daemon", "spd"))
    saved = os.environ.get("SPC_SOCKET")
    stop = T.start_spd(binary, nodes=2)
    try:
        sockets = list(T.SOCKETS)
        configs = [c for c in T.CONFIGS if c[0] in ("SP=4 Ulysses 2 x Ring 2", "SP=3 Ring")]
        table, _ = T.experiment(torch.float64, steps=2, configs=configs, log=lambda *a: None)
        for name, rows in table.items():
            for task, (dloss, dgrad, dlp, _) in rows.items():
                assert dloss <= 1e-10 and dgrad <= 1e-10 and dlp <= 1e-12, (name, task, dloss, dgrad, dlp)
        # Both daemons moved data: the ranks really were on two nodes.
        for sock in sockets:
            with spclient.attach(socket=sock) as h:
                st = h.query("status")[0]
                assert st["ops_total"] > 0 and st["ops_failed"] == 0 and st["peers_up"] == 1, st
    finally:
        stop()
        if saved is not None:
            os.environ["SPC_SOCKET"] = saved
