"""What peers say of themselves, on the page in a real headless chromium: real peers in this
process, one honest expert server and one that multiplies its answers by 1e6, and a trainer whose
mixture calls both and whose progress tracker reports a run. The dashboard, named no run, finds the
run in the trainer's answer; it shows each peer's version and uptime, the links the trainer
measured to the servers, each expert's load and its server's Forward latency, and the hostile
server's rejected answers as the trainer reported them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from browser import chrome

from swarm.core.version import __version__
from swarm.dashboard.collector import DashboardConfig
from swarm.dashboard.service import serve_dashboard

torch = pytest.importorskip("torch")
nn = torch.nn

HID = 16
RUN = "found-run"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _wait(driver, script: str, timeout: float = 30.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: d.execute_script(script))


ROWS = """return Object.fromEntries([...document.querySelectorAll('#peers tbody tr')].map(r => [r.dataset.peer, {
    version: r.children[2].textContent, roles: r.children[3].textContent, uptime: r.children[4].textContent,
    link_rtt: r.children[6].textContent, forward: r.children[8].textContent, rejected: r.children[11].textContent}]));"""


@pytest.mark.timeout(120)
def test_the_page_shows_versions_uptimes_links_expert_load_rejected_answers_and_a_run_nobody_named(
        make_peer, tmp_path):
    from swarm.moe import ExpertServer, ExpertServerConfig, RemoteMixtureOfExperts
    from swarm.moe.sources import StaticExpertSource
    from swarm.optim.config import CollaborationConfig
    from swarm.optim.tracker import ProgressTracker

    watcher = make_peer(listen=LOOPBACK)
    config = ExpertServerConfig(checkpoint_interval=None)
    torch.manual_seed(0)
    honest = ExpertServer(make_peer(listen=LOOPBACK, initial_peers=watcher.addrs), {"ffn.0": nn.Linear(HID, HID)},
                          optimizer_factory=_sgd, config=config, declare=False)
    hostile = ExpertServer(make_peer(listen=LOOPBACK, initial_peers=watcher.addrs), {"ffn.1": nn.Linear(HID, HID)},
                           optimizer_factory=_sgd, config=ExpertServerConfig(hostile="x1e6", checkpoint_interval=None),
                           declare=False)
    trainer = make_peer(listen=LOOPBACK, initial_peers=watcher.addrs)
    source = StaticExpertSource({"ffn.0": honest.peer.addrs[0], "ffn.1": hostile.peer.addrs[0]})
    moe = RemoteMixtureOfExperts(trainer, in_features=HID, grid_size=(2,), uid_prefix="ffn.", k_best=2, k_min=1,
                                 source=source)
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.05)
    for _ in range(4):
        moe(torch.randn(32, HID)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert moe.caller.misbehaviours >= 1
    tracker = ProgressTracker(trainer, RUN, CollaborationConfig(target_batch_size=64, report_period=0.2),
                              addr=trainer.addrs[0])
    trainer.run(tracker.astart(), timeout=30)
    tracker.update(1, 8, 4.0, "")

    server = serve_dashboard(watcher, DashboardConfig(refresh_period=0.5, experts_period=0.5, info_timeout=3.0))
    ids = {"watcher": watcher.peer_id, "honest": honest.peer.peer_id, "hostile": hostile.peer.peer_id,
           "trainer": trainer.peer_id}
    try:
        with chrome(tmp_path) as driver:
            driver.get(server.url)
            # the run, found in the trainer's answer, with the trainer's report
            _wait(driver, f"const r = document.querySelector('[data-run=\"{RUN}\"] .run-peers tbody tr'); "
                          f"return r && r.dataset.peer === '{trainer.peer_id}';")
            # the rejected answers as the trainer reported them, and the hostile server's expert outlined
            _wait(driver, f"const r = document.querySelector('#rejections tr.rejection'); return r && "
                          f"r.dataset.client === '{trainer.peer_id}' && r.dataset.server === '{hostile.peer.peer_id}';")
            _wait(driver, "const c = document.querySelector('#experts .cell[data-uid=\"ffn.1\"]'); "
                          "return c && c.classList.contains('rejected');")
            rows = _wait(driver, f"const rows = (() => {{ {ROWS} }})(); "
                                 f"return rows['{honest.peer.peer_id}'] && rows['{honest.peer.peer_id}'].forward "
                                 f"!== '–' && rows['{hostile.peer.peer_id}'].link_rtt !== '–' ? rows : null;")
            honest_cell = driver.execute_script(  # the title is written when the pointer comes over the cell
                "const c = document.querySelector('#experts .cell[data-uid=\"ffn.0\"]'); "
                "c.dispatchEvent(new MouseEvent('mouseover', {bubbles: true})); return c.title;")
            count = driver.execute_script("return Number(document.querySelector('#rejections tr.rejection .rejected-count')"
                                          ".textContent);")
            driver.save_screenshot(str(tmp_path / "peer-details.png"))
            errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        trainer.run(tracker.ashutdown(), timeout=30)
    assert list(trainer.describe().runs) == []  # a stopped tracker's run leaves the answer
    assert set(rows) == set(ids.values())
    assert all(r["version"] == __version__ and r["uptime"] not in ("", "–") for r in rows.values()), rows
    assert "trainer" in rows[trainer.peer_id]["roles"]
    assert rows[hostile.peer.peer_id]["rejected"] == str(count) and count >= 1
    assert rows[honest.peer.peer_id]["rejected"] == ""
    assert "batches" in honest_cell and "Forward" in honest_cell and "ffn.0 on" in honest_cell, honest_cell
    assert errors == []
