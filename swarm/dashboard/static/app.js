// The swarm's live page: server-sent events from /api/events, drawn with uPlot.
// Every string a peer reports is inserted as text (textContent, title), never parsed as HTML.
"use strict";

(function () {
  const MAX_POINTS = 4000;
  const state = { history: { peers: { t: [], count: [] }, runs: {} }, charts: {}, runCards: {}, peers: {}, experts: {},
                  rejected: new Set(), peerRows: new Map() };
  const stats = { snapshots: 0, lastRenderMs: 0, maxRenderMs: 0, totalRenderMs: 0, renders: [], expertsRenderMs: 0,
                  experts: 0, peers: 0, firstCompleteMs: null };
  window.dashboardStats = stats;
  window.dashboardCharts = state.charts;

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function fmt(value, digits) {
    if (value === null || value === undefined) return "–";
    return typeof value === "number" ? value.toFixed(digits === undefined ? 0 : digits) : String(value);
  }

  function duration(seconds) {
    if (seconds < 90) return Math.round(seconds) + " s";
    if (seconds < 5400) return Math.round(seconds / 60) + " min";
    return (seconds / 3600).toFixed(1) + " h";
  }

  function hue(id) {
    let h = 0;
    for (let i = 0; i < id.length; i++) h = (h * 31 + id.charCodeAt(i)) % 360;
    return h;
  }

  function shortId(id) {
    return id.length > 10 ? "…" + id.slice(-8) : id;
  }

  // -- charts -----------------------------------------------------------------------------------

  function chart(target, label, color, width) {
    const opts = {
      width: width || 420, height: 170, legend: { show: true },
      series: [{}, { label: label, stroke: color, width: 2, spanGaps: true, points: { show: true, size: 4 } }],
      scales: { x: { time: true } },
    };
    return new uPlot(opts, [[], []], target);
  }

  function trim(series) {
    for (const key of Object.keys(series)) {
      const extra = series[key].length - MAX_POINTS;
      if (extra > 0) series[key].splice(0, extra);
    }
  }

  // -- peers --------------------------------------------------------------------------------------

  const PEER_COLUMNS = ["", "reachability", "", "", "uptime", "rtt", "link-rtt", "link-mbps", "forward", "", "", "rejected"];

  function peerCells(p) {  // [text, title] per column of the peers table
    return [
      [p.short + (p.self ? " (this peer)" : ""), p.id], [p.reachability, null], [p.version || "?", null],
      [p.roles.length ? p.roles.join(", ") : (p.role || "peer"), p.role + (p.runs.length ? " (runs: " + p.runs.join(", ") + ")" : "")],
      [p.uptime_s === null ? "–" : duration(p.uptime_s), null], [fmt(p.rtt_ms, 1), null],
      [fmt(p.link_rtt_ms, 1), p.link_reporters + " peers measured it; it measured " + p.links + " links"],
      [fmt(p.link_mbps, 1), null], [fmt(p.forward_ms, 1), null], [duration(p.seen_s), null], [String(p.experts || ""), null],
      [String(p.rejected_answers || ""), null],
    ];
  }

  function renderPeers(snap) {
    // rows are kept per peer and only their changed cells written: most of a peer's row stays the same
    // from one snapshot to the next, and rebuilding 200 rows each time costs the page more than the rest
    const body = document.querySelector("#peers tbody");
    const kept = state.peerRows;
    const next = new Map();
    let live = 0;
    state.peers = {};
    for (const p of snap.peers) {
      state.peers[p.id] = p;
      if (p.reachability !== "unreachable") live += 1;
      let tr = kept.get(p.id);
      if (!tr) {
        tr = el("tr", "peer-row");
        tr.dataset.peer = p.id;
        for (const cls of PEER_COLUMNS) tr.appendChild(el("td", cls || null, ""));
      }
      tr.dataset.reachability = p.reachability;
      const cells = tr.children;
      peerCells(p).forEach(function ([text, title], i) {
        if (cells[i].textContent !== text) cells[i].textContent = text;
        if (title !== null && cells[i].title !== title) cells[i].title = title;
      });
      next.set(p.id, tr);
    }
    for (const [id, tr] of kept) if (!next.has(id)) tr.remove();
    let previous = null;  // puts the rows in the snapshot's order, moving only those out of place
    for (const tr of next.values()) {
      const wanted = previous ? previous.nextSibling : body.firstChild;
      if (wanted !== tr) body.insertBefore(tr, wanted);
      previous = tr;
    }
    state.peerRows = next;
    document.getElementById("peer-count").textContent = live + " answering, " + snap.peers_total + " known";
    document.getElementById("peers-note").textContent = snap.peers_truncated
      ? "Only the first " + snap.peers.length + " peers are shown." : "";
    stats.peers = snap.peers.length;
  }

  // -- training runs ------------------------------------------------------------------------------

  function table(parent, cls, headers) {  // a table with these column headers in `parent`; its body
    const node = el("table", cls);
    const head = el("tr");
    for (const h of headers) head.appendChild(el("th", null, h));
    const thead = el("thead");
    thead.appendChild(head);
    node.appendChild(thead);
    const body = el("tbody");
    node.appendChild(body);
    parent.appendChild(node);
    return body;
  }

  function runCard(runId) {
    if (state.runCards[runId]) return state.runCards[runId];
    const container = document.getElementById("runs");
    if (!Object.keys(state.runCards).length) container.replaceChildren();
    const card = el("div", "run");
    card.dataset.run = runId;
    card.appendChild(el("h3", "run-id", runId));
    const figures = el("div", "figures");
    const parts = {};
    for (const [key, label] of [["epoch", "epoch"], ["sps", "samples/s"], ["progress", "towards the target batch"],
                                ["loss", "loss (mean of peers)"], ["peers", "peers"], ["round", "last averaging round"]]) {
      const box = el("div", "figure");
      parts[key] = el("b", "run-" + key, "–");
      box.appendChild(parts[key]);
      box.appendChild(el("span", null, label));
      if (key === "progress") {
        const bar = el("div", "bar");
        parts.bar = el("div");
        bar.appendChild(parts.bar);
        box.appendChild(bar);
      }
      figures.appendChild(box);
    }
    card.appendChild(figures);
    parts.error = el("p", "note run-error");
    card.appendChild(parts.error);
    const charts = el("div", "charts");
    const lossBox = el("div", "chart loss-chart");
    const epochBox = el("div", "chart epoch-chart");
    charts.appendChild(lossBox);
    charts.appendChild(epochBox);
    card.appendChild(charts);
    parts.body = table(card, "run-peers", ["PeerID", "epoch", "samples", "samples/s", "loss", "samples in the last hour",
                                           "last round", "report age"]);
    parts.rounds = table(card, "run-rounds", ["averaging round (epoch)", "peers reporting", "group sizes", "failed",
                                              "left out of the mean"]);
    container.appendChild(card);
    state.charts[runId] = { loss: chart(lossBox, "loss", "#d9480f"), epoch: chart(epochBox, "epoch", "#3b7ddd") };
    state.runCards[runId] = parts;
    const h = state.history.runs[runId];
    if (h) drawRun(runId);
    return parts;
  }

  function drawRun(runId) {
    const h = state.history.runs[runId];
    const c = state.charts[runId];
    if (!h || !c) return;
    c.loss.setData([h.t, h.loss]);
    c.epoch.setData([h.t, h.epoch]);
  }

  function roundText(r) {
    if (!r) return "–";
    if (!r.ok) return "epoch " + r.epoch + " failed";
    return "epoch " + r.epoch + ": " + r.in_mean + " of " + r.group + " in the mean, " + fmt(r.seconds, 2) + " s";
  }

  function renderRuns(snap) {
    for (const run of snap.runs) {
      const parts = runCard(run.run_id);
      parts.epoch.textContent = fmt(run.epoch);
      parts.sps.textContent = fmt(run.sps, 1);
      parts.loss.textContent = fmt(run.loss, 3);
      parts.peers.textContent = fmt(run.num_peers);
      const last = run.last_round;
      parts.round.textContent = last ? "epoch " + last.epoch + ": group " + last.group_sizes.join("/") + ", " +
        last.failed + " failed, " + last.excluded + " left out" : "–";
      const share = run.target ? Math.min(1, run.samples / run.target) : null;
      parts.progress.textContent = run.target ? run.samples + " / " + run.target : "no target";
      parts.bar.style.width = share === null ? "0" : (100 * share).toFixed(1) + "%";
      parts.error.textContent = run.error || (run.num_peers ? "" : "no live progress reports");
      const rows = document.createDocumentFragment();
      for (const p of run.peers) {
        const tr = el("tr");
        tr.dataset.peer = p.id;
        const id = el("td", null, p.short);
        id.title = p.id;
        tr.appendChild(id);
        for (const v of [fmt(p.epoch), fmt(p.samples), fmt(p.sps, 1), fmt(p.loss, 3), fmt(p.samples_last_hour),
                         roundText(p.round), duration(p.age_s)]) {
          tr.appendChild(el("td", null, v));
        }
        rows.appendChild(tr);
      }
      parts.body.replaceChildren(rows);
      const roundRows = document.createDocumentFragment();
      for (const r of run.rounds || []) {
        const tr = el("tr");
        for (const v of [r.epoch, r.peers, r.group_sizes.join("/"), r.failed, r.excluded]) tr.appendChild(el("td", null, v));
        roundRows.appendChild(tr);
      }
      parts.rounds.replaceChildren(roundRows);
      let h = state.history.runs[run.run_id];
      if (!h) h = state.history.runs[run.run_id] = { t: [], epoch: [], sps: [], loss: [] };
      if (!h.t.length || h.t[h.t.length - 1] < snap.now) {
        h.t.push(snap.now);
        h.epoch.push(run.epoch);
        h.sps.push(run.sps);
        h.loss.push(run.loss);
        trim(h);
      }
      drawRun(run.run_id);
    }
  }

  // -- experts ------------------------------------------------------------------------------------

  function renderExperts(experts) {
    const started = performance.now();
    const box = document.getElementById("experts");
    const frag = document.createDocumentFragment();
    const hues = {};
    state.experts = {};
    for (const grid of experts.grids || []) {
      frag.appendChild(el("div", "grid-title", grid.prefix + " (" + grid.rows.length + ")"));
      const cells = el("div", "grid");
      cells.dataset.prefix = grid.prefix;
      for (const row of grid.rows) {
        const [uid, server, , queued] = row;
        const cell = el("div", state.rejected.has(server) ? "cell rejected" : "cell");
        cell.dataset.uid = uid;
        cell.dataset.server = server;
        state.experts[uid] = row;  // its title is written when the pointer comes over it
        let h = hues[server];
        if (h === undefined) h = hues[server] = hue(server);
        cell.style.cssText = "--h:" + h + ";--l:" + Math.max(25, 55 - 10 * Math.max(0, queued)) + "%";
        cells.appendChild(cell);
      }
      frag.appendChild(cells);
    }
    box.replaceChildren(frag);
    document.getElementById("expert-count").textContent =
      (experts.total || 0) + (experts.truncated ? " (capped: more exist)" : "");
    stats.experts = experts.total || 0;
    stats.expertsRenderMs = performance.now() - started;
    complete();
  }

  function expertTitle(uid) {  // from the latest grid and snapshot, when the pointer comes over the cell
    const [, server, batches, queued, rate] = state.experts[uid];
    const peer = state.peers[server];
    let text = uid + " on " + shortId(server);
    if (batches >= 0) text += ", " + batches + " batches" + (rate === null ? "" : " (" + rate.toFixed(2) + "/s)");
    if (queued >= 0) text += ", " + queued + " queued";
    if (peer && peer.forward_ms !== null) text += ", Forward " + peer.forward_ms.toFixed(1) + " ms";
    if (peer && peer.rtt_ms !== null) text += ", RTT " + peer.rtt_ms.toFixed(1) + " ms";
    if (peer && peer.rejected_answers) text += ", " + peer.rejected_answers + " answers rejected by clients";
    return text;
  }

  function markRejected(servers, on) {  // outlines the experts of servers whose answers clients rejected
    for (const server of servers) {
      for (const cell of document.querySelectorAll('#experts .cell[data-server="' + CSS.escape(server) + '"]')) {
        cell.classList.toggle("rejected", on);
      }
    }
  }

  function renderRejections(snap) {
    const rows = document.createDocumentFragment();
    let total = 0;
    for (const r of snap.rejections) {
      const tr = el("tr", "rejection");
      tr.dataset.client = r.client;
      tr.dataset.server = r.server;
      const client = el("td", null, r.client_short);
      client.title = r.client;
      const server = el("td", null, r.server_short);
      server.title = r.server;
      tr.appendChild(client);
      tr.appendChild(server);
      tr.appendChild(el("td", "rejected-count", r.count));
      rows.appendChild(tr);
      total += r.count;
    }
    document.querySelector("#rejections tbody").replaceChildren(rows);
    document.getElementById("rejection-count").textContent = snap.rejections.length ? total + " in all" : "none reported";
    const marked = new Set(snap.rejections.map(function (r) { return r.server; }));
    markRejected([...state.rejected].filter(function (x) { return !marked.has(x); }), false);
    markRejected([...marked].filter(function (x) { return !state.rejected.has(x); }), true);
    state.rejected = marked;
  }

  function complete() {  // the first moment the page shows peers and experts (page load to picture)
    if (stats.firstCompleteMs === null && stats.snapshots > 0 && stats.experts > 0) {
      stats.firstCompleteMs = performance.now();
    }
  }

  // -- the stream ---------------------------------------------------------------------------------

  function onSnapshot(snap) {
    const started = performance.now();
    document.getElementById("serving").textContent = "served by " + snap.self;
    renderPeers(snap);
    renderRuns(snap);
    renderRejections(snap);
    const note = document.getElementById("runs-note");
    if (note && !snap.runs.length) {
      note.textContent = snap.runs_named
        ? "No live progress reports of the runs named yet." : "No training run found yet: runs appear as peers report them.";
    }
    const h = state.history.peers;
    if (!h.t.length || h.t[h.t.length - 1] < snap.now) {
      h.t.push(snap.now);
      h.count.push(snap.peers.filter(function (p) { return p.reachability !== "unreachable"; }).length);
      trim(h);
    }
    if (!state.peersChart) state.peersChart = chart(document.getElementById("peers-chart"), "peers answering", "#2b8a3e", 640);
    state.peersChart.setData([h.t, h.count]);
    document.getElementById("updated").textContent = "updated " + new Date(snap.now * 1000).toLocaleTimeString();
    stats.snapshots += 1;
    stats.lastRenderMs = performance.now() - started;
    stats.maxRenderMs = Math.max(stats.maxRenderMs, stats.lastRenderMs);
    stats.totalRenderMs += stats.lastRenderMs;
    if (stats.renders.length < 1000) stats.renders.push(stats.lastRenderMs);
    complete();
  }

  function onHistory(history) {
    state.history.runs = history.runs || {};
    state.history.peers = history.peers || { t: [], count: [] };
    for (const runId of Object.keys(state.history.runs)) runCard(runId);
  }

  function status(text, st) {
    const node = document.getElementById("status");
    node.textContent = text;
    node.dataset.state = st;
  }

  document.getElementById("experts").addEventListener("mouseover", function (e) {
    const cell = e.target.closest(".cell");
    if (cell && state.experts[cell.dataset.uid]) cell.title = expertTitle(cell.dataset.uid);
  });

  function connect() {
    const source = new EventSource("/api/events");
    source.addEventListener("history", function (e) { onHistory(JSON.parse(e.data)); });
    source.addEventListener("snapshot", function (e) { onSnapshot(JSON.parse(e.data)); status("live", "live"); });
    source.addEventListener("experts", function (e) { renderExperts(JSON.parse(e.data)); });
    source.onerror = function () { status("disconnected, retrying…", "down"); };
  }

  connect();
})();
