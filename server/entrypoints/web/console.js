// Macaron operator console: releases (timeline, lineage, promote and roll back, what learned
// from forgotten tenants), live scores per release and specialist, and one turn's audit.
// Every call carries the admin key; every value is shown as text (never parsed as HTML).
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const state = { key: sessionStorage.getItem("macaron-admin-key") || "" };

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (name === "class") node.className = value;
      else if (name === "testid") node.dataset.testid = value;
      else node.setAttribute(name, value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function notice(message, done) {
    const box = $("notice");
    box.textContent = message || "";
    box.hidden = !message;
    box.classList.toggle("done", Boolean(done));
  }

  async function api(path, options) {
    const response = await fetch(path, {
      ...(options || {}),
      headers: { "Authorization": `Bearer ${state.key}`, "Content-Type": "application/json" },
    });
    const body = await response.json().catch(() => ({}));
    if (!response.ok) {
      const error = body.error || {};
      throw new Error(`${error.code || response.status}: ${error.message || "request failed"}`);
    }
    return body;
  }

  const percent = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(0)} %`);
  const short = (text, n) => (text && text.length > n ? `${text.slice(0, n)}…` : text || "");

  // --- releases ----------------------------------------------------------------------------

  async function showReleases() {
    const [{ releases }, exposed] = await Promise.all([api("/admin/releases"), api("/admin/exposure")]);
    showExposure(exposed);
    const body = document.querySelector("[data-testid=release-table] tbody");
    body.replaceChildren();
    for (const step of releases) {
      const d = step.detail;
      const run = d.run || null;
      const evaluation = run && run.evaluations.length ? run.evaluations[run.evaluations.length - 1] : null;
      const verdict = evaluation
        ? el("span", { class: `tag ${evaluation.passed ? "ok" : "bad"}` },
          evaluation.passed ? "passed" : `rejected: ${short((evaluation.reasons || []).join("; "), 80)}`)
        : "";
      const action = d.active
        ? el("span", { class: "tag ok", testid: "active" }, "active")
        : el("button", { type: "button", testid: "promote" }, "Promote");
      if (!d.active) action.addEventListener("click", () => promote(step.id));
      const row = el("tr", { class: d.active ? "active" : "", testid: "release-row" },
        el("td", {}, step.created_at.slice(0, 19).replace("T", " ")),
        el("td", { class: "mono" }, el("a", { href: "#", testid: "release-id" }, step.id)),
        el("td", { class: "mono" }, step.parent || "(root)"),
        el("td", { class: "mono" }, Object.values(d.adapters).map((a) => a.split(" ")[0]).join(" ")),
        el("td", { class: "mono" }, d.harness_version),
        el("td", { class: "mono" }, short(d.router_version, 20)),
        el("td", { class: "mono" }, run ? `${run.recipe} · ${run.snapshot.records} records` : ""),
        el("td", {}, verdict),
        el("td", {}, action));
      row.querySelector("a").addEventListener("click", (event) => {
        event.preventDefault();
        showLineage(step.id).catch((e) => notice(e.message));
      });
      body.append(row);
    }
    if (releases.length) await showLineage(releases.find((r) => r.detail.active)?.id || releases[0].id);
  }

  function showExposure(exposed) {
    const box = $("exposure");
    box.hidden = !exposed.releases.length;
    const active = exposed.active ? " (the active release among them)" : "";
    box.textContent = `Releases that learned from ${exposed.forgotten_tenants} forgotten ` +
      `tenant(s): ${exposed.releases.join(", ")}${active}`;
  }

  async function showLineage(ref) {
    const { lineage } = await api(`/admin/lineage/${encodeURIComponent(ref)}`);
    $("lineage-of").textContent = ref;
    const list = $("lineage");
    list.replaceChildren();
    for (const step of lineage) {
      const d = step.detail;
      const promotions = (d.promotions || []).map((p) => `${p.kind} ${p.at.slice(0, 19)}: ${p.reason}`);
      list.append(el("li", { testid: "lineage-step" },
        el("strong", { class: "mono" }, step.id), " ← ", step.parent || "root",
        ` · ${Object.values(d.adapters || {}).map((a) => a.split(" ")[0]).join(", ")}`,
        ` · ${d.harness_version || ""}`,
        promotions.length ? ` · ${promotions.join("; ")}` : ""));
    }
  }

  async function promote(releaseId) {
    if (!window.confirm(`Promote ${releaseId}? The running servers will serve it.`)) return;
    await carryOut(() => api("/admin/promote", { method: "POST", body: JSON.stringify({ release_id: releaseId }) }));
  }

  async function rollback() {
    if (!window.confirm("Roll back to the active release's parent?")) return;
    await carryOut(() => api("/admin/rollback", { method: "POST" }));
  }

  async function carryOut(call) {
    try {
      const done = await call();
      await showReleases();
      notice(`${done.kind} of ${done.release_id}: ${done.status}`, true);
    } catch (e) {
      notice(e.message);
    }
  }

  // --- live scores ---------------------------------------------------------------------------

  async function showScores() {
    const { scores, contract } = await api("/admin/scores");
    const body = document.querySelector("[data-testid=score-table] tbody");
    body.replaceChildren();
    for (const r of scores) {
      body.append(el("tr", { testid: "score-row" },
        el("td", { class: "mono" }, r.release_id), el("td", {}, r.specialist), el("td", {}, r.turns),
        el("td", {}, r.ups), el("td", {}, r.downs), el("td", {}, r.edits),
        el("td", {}, percent(r.thumbs_up_rate)), el("td", {}, percent(r.edit_rate)),
        el("td", {}, percent(r.action_success_rate)), el("td", {}, percent(r.genui_validity_rate)),
        el("td", {}, r.mean_latency_ms === null ? "–" : `${r.mean_latency_ms.toFixed(0)} ms`)));
    }
    const measured = document.querySelector("[data-testid=contract-table] tbody");
    measured.replaceChildren();
    for (const r of contract) {
      const suites = Object.keys(r.scores || {}).sort().map((suite) => {
        const formed = r.well_formed && suite in r.well_formed ? ` / ${r.well_formed[suite].toFixed(2)}` : "";
        return `${suite} ${r.scores[suite].toFixed(2)}${formed}`;
      });
      measured.append(el("tr", { testid: "contract-row" },
        el("td", {}, r.released_at.slice(0, 19).replace("T", " ")),
        el("td", { class: "mono" }, r.release_id), el("td", {}, r.contract_version),
        el("td", { class: "mono" }, suites.join(" · "))));
    }
    const chart = $("score-chart");
    chart.replaceChildren(
      barChart("thumbs-up rate", scores, (r) => r.thumbs_up_rate, (r) => r.specialist),
      barChart("edit rate", scores, (r) => r.edit_rate, (r) => r.specialist));
    const suites = [...new Set(contract.flatMap((r) => Object.keys(r.scores || {})))].sort();
    const releases = [...new Set(contract.map((r) => r.release_id))];
    $("contract-chart").replaceChildren(...suites.map((suite) => barChart(
      `${suite}: contract score per release, oldest first`,
      contract.filter((r) => r.scores && suite in r.scores),
      (r) => r.scores[suite],
      (r) => `#${releases.indexOf(r.release_id)}`)));
  }

  function barChart(title, rows, value, name) {
    const ns = "http://www.w3.org/2000/svg";
    const width = 40 * Math.max(rows.length, 1) + 20;
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("width", width);
    svg.setAttribute("height", 150);
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", title);
    rows.forEach((r, i) => {
      const v = value(r) || 0;
      const bar = document.createElementNS(ns, "rect");
      bar.setAttribute("x", 10 + 40 * i);
      bar.setAttribute("y", 110 - 100 * v);
      bar.setAttribute("width", 28);
      bar.setAttribute("height", Math.max(1, 100 * v));
      bar.setAttribute("fill", "#4f6bed");
      const tip = document.createElementNS(ns, "title");
      tip.textContent = `${r.release_id} ${name(r)}: ${percent(value(r))}`;
      bar.append(tip);
      const label = document.createElementNS(ns, "text");
      label.setAttribute("x", 10 + 40 * i);
      label.setAttribute("y", 126);
      label.setAttribute("class", "bar-label");
      label.textContent = name(r).slice(0, 6);
      svg.append(bar, label);
    });
    return el("figure", { testid: "bar-chart" }, svg, el("figcaption", {}, title));
  }

  // --- one turn's audit ----------------------------------------------------------------------

  async function auditTurn(turnId) {
    const a = await api(`/admin/turns/${encodeURIComponent(turnId)}/audit`);
    const served = a.served_by;
    const summary = el("dl", { class: "audit-summary", testid: "audit-summary" },
      el("dt", {}, "chain"), el("dd", { testid: "chain" },
        el("span", { class: `tag ${a.chain_ok ? "ok" : "bad"}` }, a.chain_ok ? "verified" : "broken"),
        ` ${a.chain_events} events of conversation ${a.conversation_id}`),
      el("dt", {}, "served by"), el("dd", { class: "mono", testid: "served-by" },
        `${served.release_id} · ${served.adapter_version} · router ${short(served.router_version, 24)} · ${served.harness_version} (${served.hcp_version})`),
      el("dt", {}, "trace id"), el("dd", { class: "mono" }, a.trace_id || "none (no tracer)"),
      el("dt", {}, "taught by"), el("dd", { testid: "taught-by" }, a.training
        ? `run ${a.training.run.run_id} (${a.training.run.recipe}): ` +
          Object.entries(a.training.counts).map(([k, n]) => `${n} ${k}`).join(", ")
        : "a root adapter: nothing taught it"));
    const events = el("table", { class: "grid", testid: "audit-events" },
      el("thead", {}, el("tr", {}, el("th", {}, "#"), el("th", {}, "type"), el("th", {}, "event id"), el("th", {}, "hash"))),
      el("tbody", {}, ...a.events.map((e) => el("tr", {},
        el("td", {}, e.sequence), el("td", {}, e.type), el("td", { class: "mono" }, e.event_id),
        el("td", { class: "mono" }, e.hash.slice(0, 16))))));
    $("audit-result").replaceChildren(summary, events);
  }

  async function verifyRecord() {
    const box = $("verified");
    box.hidden = false;
    box.textContent = "verifying every key's chain and every adapter's files…";
    const r = await api("/admin/audit");
    box.replaceChildren(
      el("span", { class: `tag ${r.ok ? "ok" : "bad"}` }, r.ok ? "record verified" : "record broken"),
      ` ${r.events} events on ${r.keys} keys, ${r.adapters} adapters: ` +
        `${r.chain_violations.length} chain violations, ${r.adapter_failures.length} adapter failures`,
      ...[...r.chain_violations, ...r.adapter_failures].map((p) => el("div", { class: "mono" }, p)));
  }

  // --- wiring --------------------------------------------------------------------------------

  const views = { releases: showReleases, scores: showScores, audit: async () => {} };

  async function show(view) {
    for (const name of Object.keys(views)) {
      $(name).hidden = name !== view;
      document.querySelector(`[data-view=${name}]`).setAttribute("aria-pressed", String(name === view));
    }
    if (!state.key) return notice("enter an admin key");
    try {
      notice("");
      await views[view]();
    } catch (e) {
      notice(e.message);
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("admin-key").value = state.key;
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      state.key = $("admin-key").value.trim();
      sessionStorage.setItem("macaron-admin-key", state.key);
      show("releases");
    });
    for (const tab of document.querySelectorAll("[data-view]")) {
      tab.addEventListener("click", () => show(tab.dataset.view));
    }
    $("rollback").addEventListener("click", () => rollback());
    $("verify").addEventListener("click", () => verifyRecord().catch((e) => notice(e.message)));
    $("audit-form").addEventListener("submit", (event) => {
      event.preventDefault();
      auditTurn($("turn-id").value.trim()).then(() => notice(""), (e) => notice(e.message));
    });
    show("releases");
  });
})();
