// The trajgate inspector: one Alpine.js component over the pool's JSON API (/api/...).
// Captured content is untrusted: it reaches the DOM only through x-text / attribute bindings
// (textContent / setAttribute), never as HTML. Writes send X-Trajgate-Inspector: 1 and JSON,
// which a page on another site cannot make a browser send without a CORS preflight.
"use strict";

const LIST_KEYS = ["status", "channel", "group_id", "tag", "flag", "reward_name", "reward_min",
  "reward_max", "rewarded", "policy_version", "created_after", "created_before", "q", "sort",
  "order", "offset", "limit"];
const MULTI = ["status", "tag", "flag"];
const LIVE_INTERVAL_MS = 2000;
// The token view reads a long step one window of positions at a time.
const TOKEN_PAGE = 2000;
const CHARTS_INTERVAL_MS = 5000;

function emptyFilter() {
  return { status: [], channel: "", group_id: "", tag: "", flag: "", reward_name: "",
    reward_min: "", reward_max: "", rewarded: "", policy_version: "", created_after: "",
    created_before: "", q: "", sort: "created_at", order: "desc", offset: 0, limit: 50 };
}

function splitList(text) {
  return String(text || "").split(",").map((s) => s.trim()).filter(Boolean);
}

function localToIso(value) {
  return value ? new Date(value).toISOString() : "";
}

function isoToLocal(value) {
  if (!value) return "";
  const d = new Date(value);
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

// Behaviour logprob 0 (certain) is green, -5 and below red.
function logprobColour(lp) {
  if (lp === null || lp === undefined) return "background: #ddd";
  const x = Math.max(0, Math.min(1, -lp / 5));
  return `background: hsl(${Math.round(120 * (1 - x))} 70% 80%)`;
}

// A text with edits [[start, end, insert], ...] (sorted, not overlapping) applied: the view's
// replaced messages (head_edits) against its head_texts. Offsets agree with the server's: the
// texts are ASCII JSON, so a UTF-16 code unit is a character.
function applyEdits(base, edits) {
  const parts = [];
  let at = 0;
  for (const [start, end, insert] of edits) {
    parts.push(base.slice(at, start), insert);
    at = end;
  }
  parts.push(base.slice(at));
  return parts.join("");
}

function showable(text) {
  // Make whitespace tokens visible without turning them into markup.
  return text.replace(/\n/g, "↵\n").replace(/\t/g, "→").replace(/^ $/, "·");
}

document.addEventListener("alpine:init", () => {
  window.Alpine.data("inspector", () => ({
    view: "list",
    message: "",
    messageIsError: false,
    needToken: false,
    tokenInput: "",
    // list
    f: emptyFilter(),
    rows: [],
    total: null,
    selected: [],
    cursor: 0,
    live: true,
    updatedAt: "",
    bulk: { scope: "selected", target: "trajectory", tags: "", quality: "", decision: "", note: "" },
    columns: [
      { key: "id", label: "trajectory", sort: true },
      { key: "group_id", label: "group", sort: false },
      { key: "channel", label: "channel", sort: true },
      { key: "status", label: "status", sort: true },
      { key: "steps", label: "steps", sort: false },
      { key: "tokens", label: "tokens", sort: false },
      { key: "reward", label: "reward", sort: true },
      { key: "tags", label: "tags", sort: false },
      { key: "flags", label: "flags", sort: false },
      { key: "label", label: "label", sort: false },
      { key: "created_at", label: "created", sort: true },
      { key: "last_step_at", label: "last step", sort: true },
    ],
    // trajectory / tokens / group
    traj: null,
    readinessBatch: "",
    stepOrder: [],
    isTree: false,
    isLineages: false,
    stepIndexOf: {},
    lineageDepth: {},
    // Full conversations fetched on demand, by step id (the trajectory view sends only what
    // each step added to its parent's).
    histories: {},
    tok: null,
    tokenList: [],
    tokLo: 0,
    tokHi: 0,
    tokenPageSize: TOKEN_PAGE,
    tokenMode: "text",
    tokenModeChosen: false,
    hoverText: "",
    group: null,
    groupReward: "final",
    groupAlgorithm: "grpo",
    // curation
    rules: [],
    marks: [],
    newRule: { name: "", kind: "length", action: "exclude", params: "" },
    // batches
    spec: { name: "", channel: "train", algorithm: "grpo", layout: "per_step", group_size: "",
      reward_names: "final", drop_degenerate_groups: true, exclude_batched: true,
      step_reward_names: "", step_advantage: "none" },
    specFilters: {},
    preview: null,
    batchList: [],
    batch: null,
    listReward: "",
    // charts
    chartBucket: "60",
    chartReward: "",
    rewardNames: [],
    rewardRows: [],
    chartMetric: "",
    metricNames: [],
    chartData: null,
    trainingRows: [],
    chartsLoading: false,
    plots: [],
    timer: null,
    chartTimer: null,

    init() {
      this.route();
      this.timer = setInterval(() => {
        if (this.live && this.view === "list" && !this.needToken && !document.hidden) {
          this.loadList();
        }
      }, LIVE_INTERVAL_MS);
      this.chartTimer = setInterval(() => {
        if (this.live && this.view === "charts" && !this.needToken && !document.hidden) {
          this.loadCharts();
        }
      }, CHARTS_INTERVAL_MS);
    },

    // ---- plumbing ------------------------------------------------------------------------
    async api(path, options = {}) {
      const headers = { "X-Trajgate-Inspector": "1" };
      const token = sessionStorage.getItem("trajgate-admin-token");
      if (token) headers.Authorization = `Bearer ${token}`;
      if (options.body !== undefined) headers["Content-Type"] = "application/json";
      const response = await fetch(path, {
        method: options.method || "GET",
        headers,
        body: options.body === undefined ? undefined : JSON.stringify(options.body),
      });
      if (response.status === 401) {
        this.needToken = true;
        throw new Error("the admin token is required");
      }
      if (options.raw) {
        if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
        return response;
      }
      if (response.status === 204) return null;
      const data = await response.json();
      if (!response.ok) {
        const error = (data && data.error) || {};
        const err = new Error(error.message || `${response.status}`);
        err.status = response.status;
        err.data = data;
        throw err;
      }
      return data;
    },
    say(text, isError = false) {
      this.message = text;
      this.messageIsError = isError;
    },
    fail(err) {
      this.say(String(err.message || err), true);
    },
    saveToken() {
      sessionStorage.setItem("trajgate-admin-token", this.tokenInput);
      this.tokenInput = "";
      this.needToken = false;
      this.route();
    },
    go(url) {
      history.pushState(null, "", url);
      this.route();
    },
    route() {
      const path = location.pathname.replace(/\/+$/, "");
      const parts = path.split("/").slice(2).map(decodeURIComponent);
      this.readFilter();
      this.say("");
      if (parts[0] === "trajectories" && parts[1]) return this.showTrajectory(parts[1]);
      if (parts[0] === "steps" && parts[1]) {
        // ?offset= goes to the API as written: a garbled one is its 400, never window 0 instead.
        const offset = new URLSearchParams(location.search).get("offset");
        return this.showTokens(parts[1], offset === null || offset === "" ? 0 : offset);
      }
      if (parts[0] === "groups" && parts[1]) return this.showGroup(parts[1]);
      if (parts[0] === "curation") return this.showCuration();
      if (parts[0] === "batches") return this.showBatches();
      if (parts[0] === "charts") return this.showCharts();
      this.view = "list";
      this.loadList();
    },

    // ---- filter state in the URL ---------------------------------------------------------
    readFilter() {
      const params = new URLSearchParams(location.search);
      const f = emptyFilter();
      for (const key of LIST_KEYS) {
        if (!params.has(key)) continue;
        if (key === "status") f.status = params.getAll(key);
        else if (key === "tag" || key === "flag") f[key] = params.getAll(key).join(",");
        else if (key === "offset" || key === "limit") f[key] = Number(params.get(key));
        else if (key.startsWith("created_")) f[key] = isoToLocal(params.get(key));
        else f[key] = params.get(key);
      }
      this.f = f;
    },
    apiParams() {
      const params = new URLSearchParams();
      for (const key of LIST_KEYS) {
        const value = this.f[key];
        if (key === "status") value.forEach((s) => params.append("status", s));
        else if (MULTI.includes(key)) splitList(value).forEach((v) => params.append(key, v));
        else if (key.startsWith("created_")) { if (value) params.set(key, localToIso(value)); }
        else if (value !== "" && value !== null && value !== undefined) params.set(key, value);
      }
      return params;
    },
    listSearch() {
      const params = this.apiParams();
      const defaults = emptyFilter();
      for (const key of ["sort", "order", "offset", "limit", "reward_name"]) {
        if (String(params.get(key)) === String(defaults[key])) params.delete(key);
      }
      const text = params.toString();
      return text ? `?${text}` : "";
    },
    applyFilters() {
      this.f.offset = 0;
      this.total = null;
      this.go(`/inspector${this.listSearch()}`);
    },
    clearFilters() {
      this.f = emptyFilter();
      this.applyFilters();
    },
    sortBy(key) {
      if (this.f.sort === key) this.f.order = this.f.order === "desc" ? "asc" : "desc";
      else { this.f.sort = key; this.f.order = "desc"; }
      this.f.offset = 0;
      this.go(`/inspector${this.listSearch()}`);
    },
    page(direction) {
      this.f.offset = Math.max(0, this.f.offset + direction * this.f.limit);
      this.go(`/inspector${this.listSearch()}`);
    },
    // The same selection as the curation/batch API's TrajectoryFilter; text search has no
    // field there, so it becomes the list of matching ids.
    async trajectoryFilter() {
      const f = this.f;
      const out = { reward_name: f.reward_name || this.listReward || "final" };
      if (f.channel) out.channel = f.channel;
      if (f.status.length) out.status = f.status;
      if (f.group_id) out.group_ids = [f.group_id];
      if (splitList(f.tag).length) out.tags = splitList(f.tag);
      if (splitList(f.flag).length) out.flags = splitList(f.flag);
      if (f.reward_min !== "") out.reward_min = Number(f.reward_min);
      if (f.reward_max !== "") out.reward_max = Number(f.reward_max);
      if (f.rewarded !== "") out.rewarded = f.rewarded === "true";
      if (f.policy_version !== "") out.policy_version = Number(f.policy_version);
      if (f.created_after) out.created_after = localToIso(f.created_after);
      if (f.created_before) out.created_before = localToIso(f.created_before);
      if (f.q) {
        const params = this.apiParams();
        const found = await this.api(`/api/inspector/trajectory-ids?${params}`);
        out.trajectory_ids = found.ids;
      }
      return out;
    },

    // ---- list ----------------------------------------------------------------------------
    async loadList() {
      try {
        // The count is one indexed COUNT (count_p50_ms in the benchmark): live pages keep it true.
        const params = this.apiParams();
        params.set("with_total", "true");
        const page = await this.api(`/api/inspector/trajectories?${params}`);
        this.rows = page.data;
        // The server decides the reward when none is typed: the one recorded last in the pool.
        this.listReward = page.reward_name;
        if (page.total !== null) this.total = page.total;
        const ids = new Set(this.rows.map((r) => r.id));
        this.selected = this.selected.filter((id) => ids.has(id));
        this.cursor = Math.min(this.cursor, Math.max(0, this.rows.length - 1));
        this.updatedAt = new Date().toLocaleTimeString();
        sessionStorage.setItem("trajgate-list-ids", JSON.stringify(this.rows.map((r) => r.id)));
      } catch (err) { this.fail(err); }
    },
    selectAll(on) {
      this.selected = on ? this.rows.map((r) => r.id) : [];
    },
    openTrajectory(id) {
      this.go(`/inspector/trajectories/${encodeURIComponent(id)}${this.listSearch()}`);
    },
    labelBody(fields) {
      const body = {};
      const tags = Array.isArray(fields.tags) ? fields.tags : splitList(fields.tags);
      if (tags.length) body.tags = tags;
      if (fields.quality) body.quality = fields.quality;
      if (fields.decision) body.decision = fields.decision;
      if (fields.note) body.note = fields.note;
      body.author = "inspector";
      return body;
    },
    async applyBulk() {
      const body = this.labelBody(this.bulk);
      if (Object.keys(body).length === 1) return this.say("choose tags, quality, include/exclude or a note", true);
      try {
        let filter;
        if (this.bulk.scope === "selected") {
          if (!this.selected.length) return this.say("select trajectories first (space or the checkboxes)", true);
          filter = { trajectory_ids: [...this.selected] };
        } else {
          filter = await this.trajectoryFilter();
        }
        const result = await this.api("/api/labels/bulk", {
          method: "POST", body: { ...body, target: this.bulk.target, filter } });
        this.say(`labelled ${result.ids.length} ${this.bulk.target}(s)`);
        this.loadList();
      } catch (err) { this.fail(err); }
    },
    async label(kind, id, fields) {
      const body = this.labelBody(fields);
      if (Object.keys(body).length === 1) return this.say("nothing to label", true);
      try {
        await this.api("/api/labels", { method: "POST", body: { ...body, target: kind, target_id: id } });
        this.say(`${kind} ${id}: ${this.labelText(body)}`);
        if (this.view === "trajectory" && this.traj) await this.showTrajectory(this.traj.id, true);
        if (this.view === "list") await this.loadList();
      } catch (err) { this.fail(err); }
    },
    labelText(l) {
      return [(l.tags || []).join(","), l.quality, l.decision, l.note && `“${l.note}”`]
        .filter(Boolean).join(" · ");
    },
    onKey(event) {
      const t = event.target;
      if (t && (t.tagName === "INPUT" || t.tagName === "SELECT" || t.tagName === "TEXTAREA")) return;
      if (event.ctrlKey || event.metaKey || event.altKey) return;
      const labels = { g: { quality: "good" }, b: { quality: "bad" }, u: { quality: "unsure" },
        x: { decision: "exclude" }, i: { decision: "include" } };
      if (this.view === "list") {
        const row = this.rows[this.cursor];
        if (event.key === "j") this.cursor = Math.min(this.rows.length - 1, this.cursor + 1);
        else if (event.key === "k") this.cursor = Math.max(0, this.cursor - 1);
        else if (event.key === "Enter" && row) this.openTrajectory(row.id);
        else if (event.key === " " && row) {
          this.selected = this.selected.includes(row.id)
            ? this.selected.filter((id) => id !== row.id) : [...this.selected, row.id];
        } else if (labels[event.key] && row) this.label("trajectory", row.id, labels[event.key]);
        else return;
        event.preventDefault();
      } else if (this.view === "trajectory" && this.traj) {
        if (event.key === "n" || event.key === "p") this.nextTrajectory(event.key === "n" ? 1 : -1);
        else if (labels[event.key]) this.label("trajectory", this.traj.id, labels[event.key]);
        else if (event.key === "Escape") this.go(`/inspector${this.listSearch()}`);
        else return;
        event.preventDefault();
      } else if (event.key === "Escape" && this.view === "tokens" && this.tok) {
        this.go(`/inspector/trajectories/${encodeURIComponent(this.tok.trajectory_id)}`);
      }
    },
    nextTrajectory(direction) {
      const ids = JSON.parse(sessionStorage.getItem("trajgate-list-ids") || "[]");
      const at = ids.indexOf(this.traj.id);
      const next = ids[at + direction];
      if (at >= 0 && next) this.openTrajectory(next);
      else this.say("no more trajectories on this page of the list");
    },

    // ---- trajectory ----------------------------------------------------------------------
    async showTrajectory(id, keepView = false) {
      if (!keepView) {
        this.view = "trajectory"; this.traj = null; this.readinessBatch = ""; this.histories = {};
      }
      try {
        // Readiness is judged against the newest batch spec of the channel unless one is chosen.
        const chosen = this.readinessBatch ? `?batch_id=${encodeURIComponent(this.readinessBatch)}` : "";
        const traj = await this.api(`/api/inspector/trajectories/${encodeURIComponent(id)}${chosen}`);
        this.rebuildHeads(traj);
        this.layoutSteps(traj.steps, traj.lineages || []);
        this.traj = traj;
      } catch (err) { this.fail(err); }
    },
    // Steps in call order; a tree (indented under their parent) when some step has two
    // children or its parent is not the step before it. A trajectory of several lineages is
    // laid out by lineage instead (layoutLineages).
    layoutSteps(steps, lineages = []) {
      this.stepIndexOf = Object.fromEntries(steps.map((s) => [s.id, s.step_index]));
      this.isLineages = lineages.length > 1 && steps.every((s) => s.lineage_id);
      this.lineageDepth = this.lineageDepths(lineages);
      if (this.isLineages) { this.isTree = false; this.stepOrder = this.layoutLineages(steps, lineages); return; }
      const children = new Map();
      const byId = new Map(steps.map((s) => [s.id, s]));
      let tree = false;
      steps.forEach((s, k) => {
        const parent = s.parent_step_id && byId.has(s.parent_step_id) ? s.parent_step_id : null;
        if (!children.has(parent)) children.set(parent, []);
        children.get(parent).push(s);
        if (parent && k > 0 && steps[k - 1].id !== parent) tree = true;
      });
      for (const [parent, kids] of children) if (parent && kids.length > 1) tree = true;
      this.isTree = tree;
      if (!tree) { this.stepOrder = steps.map((s) => ({ ...s, depth: 0 })); return; }
      // Depth grows at each fork, so a straight chain stays flush and each branch indents.
      const order = [];
      const visit = (parent, depth) => {
        const kids = children.get(parent) || [];
        for (const s of kids) {
          const d = kids.length > 1 ? depth + 1 : depth;
          order.push({ ...s, depth: Math.min(d, 12) });
          visit(s.id, d);
        }
      };
      visit(null, 0);
      this.stepOrder = order;
    },
    // Each lineage's steps in order; after each step, the lineages it spawned (its
    // spawning_step_id): a sub-agent or side call one level deeper, a compaction at the same
    // depth (the conversation goes on there). A lineage without a spawning step follows its
    // parent lineage's steps; one without a parent in the trajectory is a root. The first step
    // of each lineage carries lineageStart (its header). O(steps + lineages).
    layoutLineages(steps, lineages) {
      const byId = new Map(lineages.map((l) => [l.id, { ...l, stepList: [] }]));
      steps.forEach((s) => byId.get(s.lineage_id).stepList.push(s));
      const spawned = new Map();
      const after = new Map();
      const add = (map, key, l) => { if (!map.has(key)) map.set(key, []); map.get(key).push(l); };
      for (const l of byId.values()) {
        if (l.spawning_step_id) add(spawned, l.spawning_step_id, l);
        else if (l.parent_id && byId.has(l.parent_id)) add(after, l.parent_id, l);
      }
      const order = [];
      const seen = new Set();
      const visit = (l, depth) => {
        if (seen.has(l.id)) return;
        seen.add(l.id);
        const deeper = (child) => (child.kind === "compaction" ? depth : depth + 1);
        l.stepList.forEach((s, k) => {
          order.push({ ...s, depth: Math.min(depth, 12), lineageStart: k === 0 ? l : null });
          for (const child of spawned.get(s.id) || []) visit(child, deeper(child));
        });
        for (const child of after.get(l.id) || []) visit(child, deeper(child));
      };
      for (const l of byId.values()) {
        if (!l.spawning_step_id && !(l.parent_id && byId.has(l.parent_id))) visit(l, 0);
      }
      for (const l of byId.values()) visit(l, 0); // a parent cycle (headers can name one)
      return order;
    },
    // "subagent searcher (of planner) · spawned by step 0 · 2 steps · 1 training row": a
    // lineage's header above its first step.
    lineageHead(l) {
      const parts = [this.lineageText({ lineage_kind: l.kind, lineage_id: l.id, lineage_parent_id: l.parent_id })];
      const spawner = l.spawning_step_id && this.stepIndexOf[l.spawning_step_id];
      if (spawner !== undefined && spawner !== null) parts.push(`${l.kind === "subagent" ? "spawned by" : "after"} step ${spawner}`);
      parts.push(`${l.steps} step${l.steps === 1 ? "" : "s"}`);
      parts.push(`${l.rows.length} training row${l.rows.length === 1 ? "" : "s"}`);
      return parts.join(" · ");
    },
    // "row 2 (steps 1, 3)": which steps of the trajectory one merged row holds.
    rowText(r) {
      return `row ${r.segment_index} (step${r.step_ids.length === 1 ? "" : "s"} ${r.step_ids.map((id) => this.stepIndexOf[id]).join(", ")})`;
    },
    // How many parent lineages a lineage has in the trajectory (the panel's indent), once per
    // view: lineages come in order of their first step, so a parent's depth is usually known.
    lineageDepths(lineages) {
      const byId = new Map(lineages.map((l) => [l.id, l]));
      const depths = {};
      for (const l of lineages) {
        let depth = 0;
        for (let p = byId.get(l.parent_id); p && depth < 12; p = byId.get(p.parent_id)) {
          if (depths[p.id] !== undefined) { depth += depths[p.id] + 1; break; }
          depth += 1;
        }
        depths[l.id] = Math.min(depth, 12);
      }
      return depths;
    },
    // "subagent agent-a (of 5f0c7a52…)": the conversation (lineage) a step belongs to.
    // A re-send (flag resend) keeps the call id of the call it re-sent: name that call's first
    // step, so the original is found without reading ids.
    resentText(s) {
      const first = (this.traj?.steps || []).find((o) => o.call_id === s.call_id && o.id !== s.id);
      return first ? `re-sends step ${first.step_index}` : "re-sends a call not in this view";
    },
    lineageText(s) {
      const short = (id) => (id && id.length > 14 ? id.slice(0, 12) + "…" : id);
      const parent = s.lineage_parent_id ? ` (of ${short(s.lineage_parent_id)})` : "";
      return `${s.lineage_kind || "main"} ${short(s.lineage_id)}${parent}`;
    },
    // Each step's replaced first messages (head_edits: edits of a text of head_texts) as
    // head_messages, once per view: a step ships a changed system message as a few characters.
    rebuildHeads(traj) {
      const texts = traj.head_texts || {};
      for (const s of traj.steps) {
        s.head_messages = (s.head_edits || []).map((h) => JSON.parse(applyEdits(texts[h.text], h.edits)));
      }
    },
    // A step's messages as shown: the full conversation once fetched, else what it added (its
    // replaced first messages, then what it appended).
    stepMessages(s) {
      const full = this.histories[s.id];
      if (full) return (full.canonical || {}).messages || [];
      return [...(s.head_messages || []), ...(s.messages_added || [])];
    },
    stepTools(s) {
      return (s.tools_key && this.traj && this.traj.tools[s.tools_key]) || [];
    },
    // "repeats 12 messages of step 5's conversation": what the added messages follow. With
    // messages_replaced k, the first k shown take the place of the parent's first k.
    repeatsText(s) {
      if (!s.messages_base) return "";
      const parent = this.traj.steps.find((p) => p.id === s.parent_step_id);
      const where = parent ? `step ${parent.step_index}` : "the parent step";
      const k = s.messages_replaced || 0;
      const repeated = s.messages_base - k;
      const replaced = k ? ` after its first ${k === 1 ? "message" : k + " messages"}, replaced by the first below` : "";
      return `${repeated} earlier message${repeated === 1 ? "" : "s"} repeat ${where}'s conversation${replaced}; below, what this step added`;
    },
    async toggleHistory(s) {
      if (this.histories[s.id]) {
        const rest = { ...this.histories };
        delete rest[s.id];
        this.histories = rest;
        return;
      }
      try {
        const full = await this.api(`/api/inspector/steps/${encodeURIComponent(s.id)}/history`);
        this.histories = { ...this.histories, [s.id]: full };
      } catch (err) { this.fail(err); }
    },
    contentText(content) {
      if (content === null || content === undefined) return "";
      if (typeof content === "string") return content;
      if (Array.isArray(content)) {
        return content.map((part) => (part && part.text !== undefined ? part.text : JSON.stringify(part))).join("");
      }
      return JSON.stringify(content);
    },

    // ---- tokens --------------------------------------------------------------------------
    // The token view's own functions (step rewards and other step facts go elsewhere).
    // One window of TOKEN_PAGE positions first (from ?offset=), more on demand: a step of a
    // long session has tens of thousands of tokens, too many to decode and lay out at once.
    async showTokens(stepId, offset = 0) {
      this.view = "tokens";
      this.tok = null;
      this.hoverText = "";
      try {
        const tok = await this.tokenPage(stepId, offset);
        this.tokenList = this.tokenItems(tok);
        this.tokLo = tok.offset;
        this.tokHi = this.tokLo + this.tokenList.length;
        if (!tok.token_texts) this.tokenMode = "ids";
        else if (this.tokenMode === "ids" && !this.tokenModeChosen) this.tokenMode = "text";
        this.tok = tok;
      } catch (err) { this.fail(err); }
    },
    tokenPage(stepId, offset, limit = TOKEN_PAGE) {
      return this.api(`/api/steps/${encodeURIComponent(stepId)}/tokens?offset=${encodeURIComponent(offset)}&limit=${limit}`);
    },
    tokenTotal() {
      return this.tok ? this.tok.prompt_token_count + this.tok.response_token_count : 0;
    },
    async moreTokens() {
      try {
        const page = await this.tokenPage(this.tok.step_id, this.tokHi);
        const items = this.tokenItems(page);
        this.tokenList = [...this.tokenList, ...items];
        this.tokHi += items.length;
      } catch (err) { this.fail(err); }
    },
    async earlierTokens() {
      try {
        const start = Math.max(0, this.tokLo - TOKEN_PAGE);
        const page = await this.tokenPage(this.tok.step_id, start, this.tokLo - start);
        this.tokenList = [...this.tokenItems(page), ...this.tokenList];
        this.tokLo = start;
      } catch (err) { this.fail(err); }
    },
    // Where this step's own prompt tokens start (after the parent's prompt + response).
    async newTokens() {
      await this.showTokens(this.tok.step_id, this.tok.prompt_base_tokens);
    },
    // One item per prompt and response token of a window (its positions start at tok.offset):
    // its classes, logprob colour and hover text.
    tokenItems(tok) {
      const prompt = tok.prompt_token_ids || [];
      const response = tok.response_token_ids || [];
      const texts = tok.token_texts;
      const special = new Set(tok.special_token_ids || []);
      const promptCount = tok.prompt_token_count;
      return [...prompt, ...response].map((id, k) => {
        const i = tok.offset + k;
        const inResponse = i >= promptCount;
        const r = k - prompt.length;
        const lp = inResponse && tok.response_logprobs ? tok.response_logprobs[r] : null;
        const text = texts ? texts[k] : null;
        const cls = ["tk"];
        if (!inResponse) { cls.push("prompt"); if (i < tok.prompt_base_tokens) cls.push("history"); }
        if (tok.loss_mask[k]) cls.push("masked");
        if (i === promptCount) cls.push("boundary");
        if (special.has(id)) cls.push("special");
        return {
          i, id, cls: cls.join(" "),
          style: inResponse ? logprobColour(lp) : "",
          text: text === null ? String(id) : showable(text),
          special: special.has(id),
          boundary: i === promptCount,
          title: `#${i} ${inResponse ? "response" : "prompt"} · id ${id}`
            + (text === null ? "" : ` · text ${JSON.stringify(text)}`)
            + (special.has(id) ? " · special" : "")
            + (inResponse ? ` · logprob ${lp === null ? "n/a" : lp.toFixed(4)}` : "")
            + ` · loss mask ${tok.loss_mask[k]}`,
        };
      });
    },
    tokenShown(t) {
      return this.tokenMode === "ids" ? `${t.id} ` : t.text;
    },
    setTokenMode(mode) {
      this.tokenMode = mode;
      this.tokenModeChosen = true;
    },

    // ---- group ---------------------------------------------------------------------------
    async showGroup(groupId) {
      this.view = "group";
      this.group = { group_id: groupId, members: [], reward_name: this.groupReward };
      await this.loadGroup();
    },
    async loadGroup() {
      try {
        const id = this.group.group_id;
        this.group = await this.api(`/api/groups/${encodeURIComponent(id)}/rollouts?reward_name=${encodeURIComponent(this.groupReward)}&algorithm=${this.groupAlgorithm}`);
      } catch (err) { this.fail(err); }
    },

    // ---- curation ------------------------------------------------------------------------
    async showCuration() {
      this.view = "curation";
      try {
        this.rules = await this.api("/api/curation/rules");
        this.marks = await this.api("/api/curation/marks?limit=500");
      } catch (err) { this.fail(err); }
    },
    async createRule() {
      try {
        const params = this.newRule.params.trim() ? JSON.parse(this.newRule.params) : {};
        const created = await this.api("/api/curation/rules", { method: "POST", body: {
          name: this.newRule.name, kind: this.newRule.kind, action: this.newRule.action,
          params, author: "inspector" } });
        this.say(`rule ${created.name}: matched ${created.result ? created.result.matched : 0}`);
        this.newRule = { name: "", kind: "length", action: "exclude", params: "" };
        await this.showCuration();
      } catch (err) { this.fail(err); }
    },
    async deleteRule(id) {
      try {
        await this.api(`/api/curation/rules/${id}`, { method: "DELETE" });
        await this.showCuration();
      } catch (err) { this.fail(err); }
    },
    async applyRules() {
      try {
        const results = await this.api("/api/curation/apply", { method: "POST", body: {} });
        this.say(results.map((r) => `${r.name}: ${r.matched}`).join(" · ") || "no rules");
        await this.showCuration();
      } catch (err) { this.fail(err); }
    },

    // ---- batches -------------------------------------------------------------------------
    async showBatches() {
      this.view = "batches";
      this.preview = null;
      try {
        this.specFilters = await this.trajectoryFilter();
        if (this.f.channel) this.spec.channel = this.f.channel;
        this.batchList = await this.api("/api/batches?limit=200");
      } catch (err) { this.fail(err); }
    },
    specBody() {
      const s = this.spec;
      const body = { channel: s.channel || "train", algorithm: s.algorithm, layout: s.layout,
        filters: this.specFilters, drop_degenerate_groups: s.drop_degenerate_groups,
        exclude_batched: s.exclude_batched };
      if (s.name) body.name = s.name;
      if (s.group_size !== "") body.group_size = Number(s.group_size);
      const names = splitList(s.reward_names);
      body.reward_names = names;
      return Object.assign(body, this.stepCreditSpec());
    },
    // Step-level credit of the spec (docs/batches.md#step-level-credit): only what was chosen.
    stepCreditSpec() {
      const out = {};
      const names = splitList(this.spec.step_reward_names);
      if (names.length) out.step_reward_names = names;
      if (this.spec.step_advantage !== "none") out.step_advantage = this.spec.step_advantage;
      return out;
    },
    // The preview's anchor sub-groups as lines: "group g · state abcd1234: t1 step 0, t2 step 0".
    anchorLines(preview) {
      const anchor = preview && preview.step_credit && preview.step_credit.anchor;
      if (!anchor) return [];
      return anchor.subgroups_listed.map((g) => `group ${g.group_id} · state ${g.anchor_key}: `
        + g.steps.map((x) => `${x.trajectory_id} step ${x.position}`).join(", "));
    },
    fmtAdvantage(value) {
      return value === null || value === undefined ? "—" : value.toFixed(3);
    },
    async previewBatch() {
      try {
        this.preview = await this.api("/api/batches/preview", { method: "POST", body: this.specBody() });
        this.say(`preview: ${this.preview.rows} rows`);
      } catch (err) {
        this.preview = null;
        this.fail(err);
      }
    },
    async createBatch() {
      try {
        const batch = await this.api("/api/batches", { method: "POST", body: this.specBody() });
        this.say(`batch ${batch.id}: ${batch.rows} rows, ${batch.tokens} tokens`);
        this.batchList = await this.api("/api/batches?limit=200");
        this.batch = batch;
      } catch (err) { this.fail(err); }
    },
    async openBatch(id) {
      try { this.batch = await this.api(`/api/batches/${id}`); } catch (err) { this.fail(err); }
    },
    async download(id) {
      try {
        const response = await this.api(`/api/batches/${id}/rows?format=parquet`, { raw: true });
        const url = URL.createObjectURL(await response.blob());
        const a = document.createElement("a");
        a.href = url;
        a.download = `${id}.parquet`;
        document.body.appendChild(a);
        a.click();
        a.remove();
        setTimeout(() => URL.revokeObjectURL(url), 10000);
      } catch (err) { this.fail(err); }
    },

    // ---- charts --------------------------------------------------------------------------
    async showCharts() {
      this.view = "charts";
      await this.$nextTick();
      await this.loadCharts();
    },
    // Live like the list: re-read while the charts are open and visible (training metrics grow
    // while the trainer runs). One load at a time.
    async loadCharts() {
      if (this.chartsLoading) return;
      this.chartsLoading = true;
      try {
        const reward = this.chartReward ? `&reward_name=${encodeURIComponent(this.chartReward)}` : "";
        const data = await this.api(`/api/charts?bucket_s=${this.chartBucket}${reward}`);
        const metrics = await this.api("/api/training-metrics?limit=100000");
        this.chartData = data;
        this.rewardNames = data.reward_names;
        this.chartReward = data.reward_name || "";
        this.rewardRows = data.reward_by_version;
        this.metricNames = [...new Set(metrics.flatMap((r) => Object.keys(r.metrics)))].sort();
        if (!this.metricNames.includes(this.chartMetric)) {
          this.chartMetric = this.metricNames.includes("loss") ? "loss" : (this.metricNames[0] || "");
        }
        this.trainingRows = metrics;
        this.drawCharts();
      } catch (err) { this.fail(err); } finally { this.chartsLoading = false; }
    },
    drawCharts() {
      const data = this.chartData;
      this.plots.forEach((p) => p.destroy());
      this.plots = [];
      this.drawReward(data.reward_by_version);
      this.drawSteps(data.steps_over_time);
      this.drawHistogram("chart-completion", data.completion_tokens_histogram, "steps");
      this.drawHistogram("chart-prompt", data.prompt_tokens_histogram, "steps");
      this.drawFlags(data.flag_rates);
      this.drawTraining(this.trainingRows);
    },
    plot(id, opts, data) {
      const el = document.getElementById(id);
      el.textContent = "";
      if (!data[0].length) { el.textContent = "no data yet"; return; }
      const width = Math.max(320, Math.min(560, el.parentElement.clientWidth - 16));
      this.plots.push(new window.uPlot({ width, height: 220, ...opts }, data, el));
    },
    // One bucket alone would make uPlot span years around it: pad by a bucket either side.
    timeRange() {
      const pad = Number(this.chartBucket);
      return (u, min, max) => (min === max ? [min - pad, max + pad] : [min, max]);
    },
    // An axis of counts (policy versions, optimiser steps, tokens): ticks at whole numbers only.
    integerAxis(label) {
      return { label, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000],
        values: (u, ticks) => ticks.map((v) => String(Math.round(v))) };
    },
    // A fixed range around the values (uPlot's own range spans 0-100 around a single point).
    integerScale(values) {
      if (!values.length) return { time: false };
      const lo = Math.min(...values);
      const hi = Math.max(...values);
      return { time: false, range: lo === hi ? [lo - 1, hi + 1] : [lo, hi] };
    },
    palette(k) {
      return ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b"][k % 7];
    },
    // Mean reward per policy version, one line per channel (trained and control side by side),
    // a band of ± one standard error around each; n per point in the table below the chart.
    drawReward(points) {
      const versions = [...new Set(points.map((p) => p.policy_version ?? -1))].sort((a, b) => a - b);
      const channels = [...new Set(points.map((p) => p.channel))].sort();
      const at = (c, v) => points.find((p) => p.channel === c && (p.policy_version ?? -1) === v);
      const series = [{ label: "policy v" }];
      const columns = [versions];
      const bands = [];
      channels.forEach((c, k) => {
        const colour = this.palette(k);
        const mean = versions.map((v) => (at(c, v) ? at(c, v).mean : null));
        const se = versions.map((v) => (at(c, v) ? at(c, v).stderr ?? 0 : null));
        const base = columns.length;
        columns.push(mean, mean.map((m, i) => (m === null ? null : m + se[i])), mean.map((m, i) => (m === null ? null : m - se[i])));
        series.push({ label: `${c} mean`, stroke: colour, width: 2, spanGaps: true, points: { show: true, size: 6 } },
          { label: `${c} +1 SE`, stroke: colour + "55", width: 1, dash: [4, 4], spanGaps: true, points: { show: false } },
          { label: `${c} −1 SE`, stroke: colour + "55", width: 1, dash: [4, 4], spanGaps: true, points: { show: false } });
        bands.push({ series: [base + 1, base + 2], fill: colour + "22" });
      });
      this.plot("chart-reward", {
        scales: { x: this.integerScale(versions) },
        axes: [this.integerAxis("policy version"), { label: this.chartReward }],
        series, bands,
      }, columns);
    },
    drawSteps(points) {
      this.plot("chart-steps", {
        scales: { x: { range: this.timeRange() } },
        series: [{}, { label: "steps", stroke: "#1f77b4", width: 2, scale: "steps" },
          { label: "tokens", stroke: "#ff7f0e", width: 2, scale: "tokens" }],
        axes: [{}, { scale: "steps" }, { scale: "tokens", side: 1, grid: { show: false } }],
      }, [points.map((p) => p.t), points.map((p) => p.steps), points.map((p) => p.prompt_tokens + p.completion_tokens)]);
    },
    drawHistogram(id, hist, label) {
      const xs = hist.counts.map((_, k) => k * hist.width);
      const bars = window.uPlot.paths.bars({ size: [0.9, 40] });
      this.plot(id, {
        scales: { x: { time: false } },
        axes: [this.integerAxis("tokens ≥"), {}],
        series: [{ label: "tokens ≥" }, { label, stroke: "#2ca02c", fill: "#2ca02c88", paths: bars, points: { show: false } }],
      }, [xs, hist.counts]);
    },
    drawFlags(rates) {
      const xs = rates.versions.map((v) => v.policy_version ?? -1);
      this.plot("chart-flags", {
        scales: { x: this.integerScale(xs) },
        axes: [this.integerAxis("policy version"), {}],
        series: [{ label: "policy v" }, ...rates.flags.map((f, k) => ({ label: f, stroke: this.palette(k), width: 2, points: { show: true } }))],
      }, [xs, ...rates.flags.map((f) => rates.versions.map((v) => v.rates[f]))]);
    },
    // One metric at a time (their scales differ by orders of magnitude), one line per run.
    drawTraining(rows) {
      const name = this.chartMetric;
      const mine = rows.filter((r) => r.metrics[name] !== undefined);
      const steps = [...new Set(mine.map((r) => r.step))].sort((a, b) => a - b);
      const runs = [...new Set(mine.map((r) => r.run))].sort();
      const latest = new Map(mine.map((r) => [`${r.run}|${r.step}`, r.metrics[name]]));
      this.plot("chart-training", {
        scales: { x: this.integerScale(steps) },
        axes: [this.integerAxis("optimiser step"), { label: name }],
        series: [{ label: "step" }, ...runs.map((run, k) => ({ label: `${run} ${name}`, stroke: this.palette(k), width: 2, spanGaps: true, points: { show: true } }))],
      }, [steps, ...runs.map((run) => steps.map((st) => latest.get(`${run}|${st}`) ?? null))]);
    },
    fmtSe(value) {
      return value === null || value === undefined ? "—" : `± ${Number(value).toFixed(3)}`;
    },

    specText(spec) {
      const needs = `requires ${spec.reward_names.join(", ")}`;
      if (spec.source === "batch") {
        return `judged against the spec of batch ${spec.name || spec.batch_id} (channel ${spec.channel}, ${this.fmtTime(spec.created_at)}): ${needs}`;
      }
      if (spec.source === "chosen") return `judged against a chosen spec: ${needs}`;
      return `no batch of channel ${spec.channel} yet: judged against the pool's newest reward name: ${needs}`;
    },

    // ---- formatting ----------------------------------------------------------------------
    fmtReward(value) {
      return value === undefined || value === null ? "unrewarded" : Number(value).toFixed(3);
    },
    fmtRewards(rewards) {
      const entries = Object.entries(rewards || {});
      return entries.length ? entries.map(([k, v]) => `${k}=${Number(v).toFixed(3)}`).join(" ") : "unrewarded";
    },
    fmtTime(value) {
      return value ? new Date(value).toLocaleString() : "";
    },
    fmtMs(value) {
      return value === null || value === undefined ? "—" : `${Math.round(value)} ms`;
    },
  }));
});
