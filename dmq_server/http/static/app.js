// dmq console: a few pages over the JSON admin API (/admin). Plain JavaScript, no build
// step, no library. Every value from the server is put in the page as text (textContent),
// never as HTML. Changes are sent from this origin (the browser says so: Sec-Fetch-Site, Origin)
// and, once signed in, with the admin token; the server decides what is allowed (read-only
// without the token).
"use strict";

const REFRESH_MS = 5000;
const state = { token: sessionStorage.getItem("dmq-token") || "", admin: false, timer: null, route: "" };

// -- plumbing ---------------------------------------------------------------------------
class ApiError extends Error {
  constructor(status, code, message) { super(message); this.status = status; this.code = code; }
}

async function api(method, path, params) {
  const query = params ? "?" + new URLSearchParams(Object.entries(params).filter(([, v]) => v !== "" && v != null)) : "";
  const headers = { "Accept": "application/json" };
  if (state.token) headers["Authorization"] = "Bearer " + state.token;
  const reply = await fetch("/admin/" + path + query, { method, headers, credentials: "omit", cache: "no-store" });
  let payload = null;
  try { payload = await reply.json(); } catch (e) { payload = null; }
  if (!reply.ok) {
    throw new ApiError(reply.status, payload && payload.error, (payload && payload.message) || reply.statusText);
  }
  return payload;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value == null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child == null || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

// replaceChildren with the same flattening as el(): page builders pass arrays and "" freely
function fill(node, ...children) {
  node.replaceChildren(...children.flat(Infinity).filter((c) => c != null && c !== false && c !== "")
    .map((c) => (c instanceof Node ? c : document.createTextNode(String(c)))));
}

const svgNS = "http://www.w3.org/2000/svg";
function svg(tag, attrs, ...children) {
  const node = document.createElementNS(svgNS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function sparkline(series, opts) {
  const w = (opts && opts.width) || 120, h = (opts && opts.height) || 26;
  const box = svg("svg", { class: "spark", width: w, height: h, viewBox: `0 0 ${w} ${h}` });
  const all = series.flat().filter((v) => v != null);
  const max = Math.max(1, ...all);
  series.forEach((values, i) => {
    if (values.length < 2) return;
    const step = w / (values.length - 1);
    const points = values.map((v, j) => `${(j * step).toFixed(1)},${(h - 2 - (v / max) * (h - 4)).toFixed(1)}`);
    box.append(svg("polyline", { points: points.join(" "), class: i ? "second" : "first" }));
  });
  box.append(svg("title", {}, (opts && opts.title) || `max ${max}`));
  return box;
}

function rates(times, counts) {
  const out = [];
  for (let i = 1; i < counts.length; i++) {
    const dt = times[i] - times[i - 1];
    out.push(dt > 0 ? Math.max(0, (counts[i] - counts[i - 1]) / dt) : 0);
  }
  return out;
}

const fmt = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US", { maximumFractionDigits: 1 }));
const when = (ms) => (ms ? new Date(ms).toISOString().replace("T", " ").replace("Z", "") : "–");
// a byte count in binary units (1,536 -> "1.5 KiB")
const bytes = (n) => {
  if (n == null) return "–";
  const units = ["bytes", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  for (; Math.abs(n) >= 1024 && i < units.length - 1; i++) n /= 1024;
  return `${fmt(n)} ${units[i]}`;
};
function age(seconds) {
  if (seconds == null) return "–";
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  if (seconds < 172800) return `${(seconds / 3600).toFixed(1)} h`;
  return `${(seconds / 86400).toFixed(1)} d`;
}
const traceLink = (id) => (id == null ? "–" : el("a", { href: `#/trace/${id}`, class: "trace-link" }, String(id)));

// A message's properties (the trace, peek, the delay view). Header names and values are the
// sender's text: like every value they go in as text nodes, so markup in them shows as typed.
function headersList(headers) {
  const entries = Object.entries(headers || {});
  return entries.length
    ? el("dl", { class: "headers" }, entries.map(([name, value]) => [el("dt", {}, name), el("dd", {}, value)]))
    : "–";
}
const propertyFacts = (m) => [["key", m.key ?? "–"], ["priority", m.priority],
  ...(m.trace_id ? [["trace id", m.trace_id]] : []), ["headers", headersList(m.headers)]];
const propertyCells = (m) => [el("td", { class: "key" }, m.key ?? "–"), el("td", { class: "num priority" }, String(m.priority)),
  el("td", { class: "headers" }, headersList(m.headers))];
const factRows = (facts) => facts.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v instanceof Node ? v : String(v))]);
const enc = encodeURIComponent;

function say(text, kind) {
  const status = document.getElementById("status");
  status.replaceChildren(el("span", { class: `msg ${kind || "ok"}`, id: "status-msg" }, text));
}
function failed(error) {
  const hint = error.status === 401 || error.status === 403 ? " (sign in with the admin token to change things)" : "";
  say(`${error.code || "error"}: ${error.message}${hint}`, "error");
}

function confirmed(text) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent = text;
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "yes"), { once: true });
    dialog.showModal();
  });
}

function actionButton(label, run, opts) {
  const danger = opts && opts.danger;
  return el("button", {
    type: "button",
    class: [danger ? "danger" : "", state.admin ? "" : "needs-admin"].join(" ").trim(),
    title: state.admin ? null : "needs the admin token: the server will refuse it",
    "data-action": (opts && opts.name) || label.toLowerCase(),
    onclick: async (event) => {
      event.preventDefault();
      try {
        // a confirmation may ask the server first (a seek's dry run): its refusal shows as the action's would
        if (opts && opts.confirm && !(await confirmed(typeof opts.confirm === "function" ? await opts.confirm() : opts.confirm))) return;
        const message = await run();
        say(message || `${label}: done`);
        render();
      } catch (error) {
        failed(error);
      }
    },
  }, label);
}

// -- who am I ---------------------------------------------------------------------------
async function whoami() {
  try {
    const me = await api("GET", "whoami");
    state.admin = me.admin;
  } catch (error) {
    state.admin = false;
    if (error.status === 401 && state.token) {  // a wrong token: forget it
      state.token = "";
      sessionStorage.removeItem("dmq-token");
      failed(error);
    }
  }
  const mode = document.getElementById("mode");
  mode.textContent = state.admin ? "admin" : "read-only";
  mode.className = `badge ${state.admin ? "admin" : "read"}`;
  document.getElementById("signin").hidden = !!state.token;
  document.getElementById("signout").hidden = !state.token;
}

document.getElementById("signin").addEventListener("submit", async (event) => {
  event.preventDefault();
  state.token = document.getElementById("token").value.trim();
  document.getElementById("token").value = "";
  sessionStorage.setItem("dmq-token", state.token);
  await whoami();
  if (state.admin) say("signed in: changes allowed");
  render();
});
document.getElementById("signout").addEventListener("click", async () => {
  state.token = "";
  sessionStorage.removeItem("dmq-token");
  await whoami();
  render();
});

// -- pages ------------------------------------------------------------------------------
function historyIndex(history) {
  const out = {};
  for (const c of history.channels) out[`${c.store}/${c.topic}/${c.channel}`] = c;
  return out;
}

function channelActions(topic, channel, paused) {
  const path = `channels/${enc(topic)}/${enc(channel)}/`;
  return el("span", { class: "actions" },
    paused
      ? actionButton("Unpause", () => api("POST", path + "unpause").then((r) => r.ok), { name: "unpause" })
      : actionButton("Pause", () => api("POST", path + "pause").then((r) => r.ok), { name: "pause" }),
    actionButton("Empty", () => api("POST", path + "empty").then((r) => r.ok),
      { name: "empty", danger: true, confirm: `Empty ${topic}/${channel}? Every message waiting in it is dropped.` }));
}

// -- seek: deliver a channel's stored messages again (dmq channel seek, docs/admin.md) -----------
const SEEK_KINDS = [["time", "a time"], ["ago", "a duration ago"], ["id", "a message id"], ["latest", "the latest: skip what waits"]];
const AGO = /^(\d+(?:\.\d+)?)(ms|s|m|h|d)$/;  // the server's durations (dmq_client/spelling.py)
const AGO_MS = { ms: 1, s: 1000, m: 60000, h: 3600000, d: 86400000 };
const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

// What the form holds, kept across the page's refreshes (the page is rebuilt every few seconds).
function seekValues(topic, channel) {
  const key = `${topic}/${channel}`;
  if (!state.seek || state.seek.key !== key) state.seek = { key, kind: "time", time: "", ago: "", id: "" };
  return state.seek;
}

// The target as the API's parameters. A time and a duration ago become Unix ms here, once: the
// dry run and the seek after it must name the same instant (the server would read "1h" twice,
// seconds apart). A datetime-local value has no offset, so Date reads it as the browser's local
// time. Text this does not read goes to the server as typed: its refusal says what is wrong.
function seekTarget(values) {
  if (values.kind === "latest") return { to_latest: "true" };
  if (values.kind === "id") return { to_id: values.id.trim() };
  if (values.kind === "ago") {
    const ago = values.ago.trim().toLowerCase().match(AGO);
    return { to_time: ago ? String(Date.now() - Math.round(Number(ago[1]) * AGO_MS[ago[2]])) : values.ago.trim() };
  }
  const ms = values.time ? new Date(values.time).getTime() : NaN;
  return { to_time: Number.isNaN(ms) ? values.time : String(ms) };
}

// Every cluster's report summed: how many, and the first of them (the lowest id) with its time.
function seekTotal(clusters) {
  const first = clusters.filter((c) => c.count).reduce((a, c) => (a && a.target_id <= c.target_id ? a : c), null);
  return { count: clusters.reduce((n, c) => n + c.count, 0), first, waited: clusters.some((c) => c.previous_id != null),
    epochs: [...new Set(clusters.map((c) => c.epoch))].join(", ") };
}

function seekForm(topic, channel) {
  const values = seekValues(topic, channel);
  const path = `channels/${enc(topic)}/${enc(channel)}/seek`;
  let target = null;  // read once per click, for the dry run and the seek alike
  const button = actionButton("Seek", async () => {
    const done = seekTotal((await api("POST", path, target)).clusters);
    return `sought ${topic}/${channel}: ${plural(done.count, "message")} to deliver again, epoch ${done.epochs}`;
  }, { name: "seek", danger: true, confirm: async () => {
    target = seekTarget(values);
    const dry = seekTotal((await api("POST", path, { ...target, dry_run: "true" })).clusters);
    if (dry.count) {
      return `${plural(dry.count, "message")} of ${topic} will be delivered again to ${channel} only; `
        + `from id ${dry.first.target_id} (${when(dry.first.target_ms)} UTC).`;
    }
    return `No message of ${topic} will be delivered again to ${channel}; `
      + (dry.waited ? "the messages waiting in it now are skipped." : "nothing waits in it now.");
  } });
  const field = (kind, label, input) => el("label", { hidden: values.kind !== kind, dataset: { kind } }, label, input);
  const remember = (name) => (event) => { values[name] = event.target.value; };
  const form = el("form", { class: "filters", id: "seek-form", onsubmit: (event) => { event.preventDefault(); button.click(); } },
    el("label", {}, "deliver again from", el("select", { name: "kind", onchange: (event) => {
      values.kind = event.target.value;
      for (const label of form.querySelectorAll("label[data-kind]")) label.hidden = label.dataset.kind !== values.kind;
    } }, SEEK_KINDS.map(([v, t]) => el("option", { value: v, selected: v === values.kind }, t)))),
    field("time", "time (your local time)", el("input", { type: "datetime-local", step: 1, name: "time", value: values.time, oninput: remember("time") })),
    field("ago", "how long ago", el("input", { name: "ago", value: values.ago, placeholder: "30m, 2h, 7d", oninput: remember("ago") })),
    field("id", "message id", el("input", { name: "id", value: values.id, inputmode: "numeric", oninput: remember("id") })),
    button);
  return [el("h2", {}, "Seek: deliver stored messages again"),
    el("p", { class: "muted" }, `Every stored message of ${topic} from the target on waits in ${channel} again (no other channel); `
      + "what waits before it is skipped. The confirmation gives the count of a dry run; the seek is in the audit log."),
    form];
}

async function topicsPage(page) {
  const [overview, history] = await Promise.all([api("GET", "overview"), api("GET", "history")]);
  const series = historyIndex(history);
  const stored = overview.stored || {};
  const letters = Object.entries(stored.dead_letters || {});
  const delayed = Object.values(stored.delay_pending || {}).reduce((a, b) => a + b, 0);
  const cards = el("div", { class: "cards" },
    el("div", { class: "card" }, el("div", { class: "value", id: "topic-count" }, fmt(overview.topics.length)), el("div", { class: "label" }, "topics")),
    el("div", { class: "card" }, el("div", { class: "value", id: "dead-letter-count" }, fmt(letters.reduce((a, [, v]) => a + v.unreplayed, 0))),
      el("div", { class: "label" }, "dead letters not replayed ", letters.map(([r, v]) => `${r} ${v.unreplayed} `))),
    el("div", { class: "card" }, el("div", { class: "value" }, fmt(delayed)), el("div", { class: "label" }, "delayed messages waiting")),
    el("div", { class: "card" }, el("div", { class: "value" }, overview.healthy ? "OK" : "failing"),
      el("div", { class: "label" }, overview.healthy ? "storage" : overview.health_detail)));
  const rows = [];
  // the PostgreSQL cluster of a reliable topic, when there are several (docs/operations.md)
  const where = (topic) => (topic.cluster && topic.cluster !== "main") || (topic.draining || []).length
    ? `${topic.store} on ${topic.cluster}${(topic.draining || []).map((d) => `, draining ${d}`).join("")}` : topic.store;
  // what PostgreSQL keeps of a reliable topic (counted by the retention sweep, up to retained_as_of)
  const kept = (topic) => topic.retained
    ? el("div", { class: "muted retained", title: topic.retained.retained_as_of == null ? "not counted yet"
        : `every message published before ${when(topic.retained.retained_as_of)} counted; younger ones not yet` },
      `keeps ${fmt(topic.retained.retained_messages)} messages, ${bytes(topic.retained.retained_bytes)}`) : "";
  // an ordered topic (dmq topic create --ordered): a channel has one copy of a key in flight at a time
  const ordered = (topic) => (topic.settings || {}).ordered
    ? el("span", { class: "ordered", title: "per channel, at most one copy of a message key in flight at a time" }, " ordered") : "";
  for (const topic of overview.topics) {
    if (!topic.channels.length) {  // a fast topic keeps what it gets for its first channel (nsqd)
      rows.push(el("tr", { dataset: { topic: topic.topic, store: topic.store } }, el("td", {}, topic.topic), el("td", {}, where(topic), ordered(topic), kept(topic)),
        topic.store === "fast"
          ? [el("td", { class: "muted" }, "no channel"), el("td", { class: "num depth" }, fmt(topic.depth)),
            el("td", { colspan: 9, class: "muted" }, "messages wait in the topic for its first channel")]
          : el("td", { colspan: 11, class: "muted" }, "no channel: sends are refused")));
    }
    for (const c of topic.channels) {
      const key = `${topic.store}/${topic.topic}/${c.channel_name}`;
      const h = series[key];
      const inRate = h ? rates(h.t, h.message_count) : [];
      const ackRate = h ? rates(h.t, h.ack_count) : [];
      rows.push(el("tr", { dataset: { topic: topic.topic, channel: c.channel_name, store: topic.store } },
        el("td", {}, topic.topic),
        el("td", {}, where(topic), ordered(topic), kept(topic)),
        el("td", {}, topic.store === "reliable"
          ? el("a", { href: `#/channel/${enc(topic.topic)}/${enc(c.channel_name)}` }, c.channel_name) : c.channel_name),
        el("td", { class: "num depth" }, fmt(c.depth)),
        el("td", { class: "num in-flight" }, fmt(c.in_flight_count)),
        el("td", { class: "num deferred" }, fmt(c.deferred_count)),
        el("td", { class: "num" }, fmt(topic.store === "reliable" ? c.clients : c.client_count)),
        el("td", { class: "num" }, fmt(inRate.length ? inRate[inRate.length - 1] : null)),
        el("td", { class: "num" }, fmt(ackRate.length ? ackRate[ackRate.length - 1] : null)),
        el("td", { class: "num oldest" }, age(c.oldest_age)),
        el("td", {}, h ? sparkline([h.depth], { title: "depth, last 10 minutes" }) : "", " ",
          h ? sparkline([inRate, ackRate], { title: "in (blue) and acknowledged (green) per second" }) : ""),
        el("td", {}, c.paused ? el("span", { class: "paused" }, "paused") : ""),
        el("td", {}, topic.store === "reliable" ? channelActions(topic.topic, c.channel_name, c.paused) : "")));
    }
  }
  fill(page, 
    el("h1", {}, "Topics and channels"),
    cards,
    el("table", { id: "topics" },
      el("thead", {}, el("tr", {}, ["Topic", "Store", "Channel"].map((t) => el("th", {}, t)),
        ["Depth", "In flight", "Deferred", "Consumers", "In/s", "Acked/s", "Oldest"].map((t) => el("th", { class: "num" }, t)),
        el("th", {}, "Last 10 minutes"), el("th", {}, ""), el("th", {}, ""))),
      el("tbody", {}, rows)),
    el("p", { class: "muted" }, `Node ${overview.node_id}. Depth, in flight and rates are this node's (a reliable channel's depth counts what PostgreSQL holds for every node); refreshed every ${REFRESH_MS / 1000} s.`));
}

async function channelPage(page, topic, channel, after) {
  const [info, history, peek] = await Promise.all([
    api("GET", `channels/${enc(topic)}/${enc(channel)}`),
    api("GET", "history", { topic }),
    api("GET", `channels/${enc(topic)}/${enc(channel)}/peek`, { after: after || 0, limit: 20 }),
  ]);
  const s = info.stats;
  const h = history.channels.find((c) => c.channel === channel && c.store === "reliable");
  const figures = el("div", { class: "cards" },
    ["depth", "in_flight_count", "deferred_count", "message_count", "delivery_count", "redelivery_count", "ack_count", "timeout_count", "requeue_count"]
      .map((k) => el("div", { class: "card" }, el("div", { class: `value ${k}` }, fmt(s[k])), el("div", { class: "label" }, k.replace(/_count$/, "").replace(/_/g, " ")))));
  const charts = h ? el("div", { class: "cards" },
    el("div", { class: "card" }, el("div", { class: "label" }, "depth (blue), in flight (green)"), sparkline([h.depth, h.in_flight_count], { width: 360, height: 60 })),
    el("div", { class: "card" }, el("div", { class: "label" }, "in (blue), acknowledged (green) per second"), sparkline([rates(h.t, h.message_count), rates(h.t, h.ack_count)], { width: 360, height: 60 }))) : "";
  const consumers = info.consumers.length
    ? el("table", { id: "consumers" }, el("thead", {}, el("tr", {}, el("th", {}, "Consumer"), el("th", { class: "num" }, "Credit"), el("th", { class: "num" }, "In flight"))),
      el("tbody", {}, info.consumers.map((c) => el("tr", {}, el("td", {}, c.name), el("td", { class: "num" }, fmt(c.credit)), el("td", { class: "num" }, fmt(c.in_flight))))))
    : el("p", { class: "muted" }, "No consumer connected to this node.");
  const peekRows = peek.messages.map((m) => el("tr", { dataset: { messageId: m.message_id } },
    el("td", {}, traceLink(m.message_id)),
    el("td", {}, when(m.published_ms)),
    el("td", { class: "num" }, fmt(m.attempts)),
    el("td", {}, m.live ? `${m.live.state.replace("_", " ")}${m.live.consumer ? " to " + m.live.consumer : ""}` : (m.owner ? `stored (owner ${m.owner})` : "stored")),
    propertyCells(m),
    el("td", { class: "num" }, fmt(m.size)),
    el("td", {}, el("code", { class: "preview" }, m.body_encoding === "utf-8" ? m.body.slice(0, 160) : "(binary, base64) " + m.body.slice(0, 80)))));
  fill(page, 
    el("h1", {}, `${topic} / ${channel}`, info.stats.paused ? el("span", { class: "paused" }, "  paused") : ""),
    channelActions(topic, channel, info.stats.paused),
    figures, charts,
    seekForm(topic, channel),
    el("h2", {}, "Consumers on this node"), consumers,
    el("h2", {}, "Waiting messages (peek: nothing is consumed)"),
    peek.messages.length
      ? el("table", { id: "peek" }, el("thead", {}, el("tr", {}, ["Message", "Published", "Attempts", "State", "Key", "Priority", "Headers", "Bytes", "Body"].map((t) => el("th", {}, t)))), el("tbody", {}, peekRows))
      : el("p", { class: "muted", id: "peek-empty" }, "Nothing waiting."),
    el("div", { class: "actions" },
      after ? el("a", { href: `#/channel/${enc(topic)}/${enc(channel)}` }, "first page") : "",
      peek.next_after ? el("a", { href: `#/channel/${enc(topic)}/${enc(channel)}/after/${peek.next_after}` }, "next page") : ""));
}

const REASONS = ["", "rate_limited", "storage_failure", "expired", "max_attempts", "client_reported", "operator"];
const DLQ_FIELDS = ["topic", "channel", "reason", "since", "until", "replayed"];

function dlqFilters() {
  const params = new URLSearchParams(location.hash.split("?")[1] || "");
  return Object.fromEntries(DLQ_FIELDS.map((k) => [k, params.get(k) || ""]));
}

async function deadLettersPage(page) {
  const filters = dlqFilters();
  const [list, count] = await Promise.all([api("GET", "dead-letters", { ...filters, limit: 100 }), api("GET", "dead-letters/count", filters)]);
  const form = el("form", { class: "filters", id: "dlq-filters", onsubmit: (event) => {
    event.preventDefault();
    const values = Object.fromEntries(DLQ_FIELDS.map((k) => [k, form.elements[k].value.trim()]).filter(([, v]) => v));
    location.hash = "#/dead-letters?" + new URLSearchParams(values);
  } },
    el("label", {}, "topic", el("input", { name: "topic", value: filters.topic })),
    el("label", {}, "channel", el("input", { name: "channel", value: filters.channel })),
    el("label", {}, "reason", el("select", { name: "reason" }, REASONS.map((r) => el("option", { value: r, selected: r === filters.reason }, r || "any")))),
    el("label", {}, "since", el("input", { name: "since", value: filters.since, placeholder: "1h, ISO time, ms" })),
    el("label", {}, "until", el("input", { name: "until", value: filters.until, placeholder: "now" })),
    el("label", {}, "replayed", el("select", { name: "replayed" }, [["", "any"], ["false", "not yet"], ["true", "replayed"]].map(([v, t]) => el("option", { value: v, selected: v === filters.replayed }, t)))),
    el("button", { type: "submit" }, "Filter"));
  const selected = () => [...page.querySelectorAll("input.pick:checked")].map((box) => box.value);
  const described = Object.entries(filters).filter(([, v]) => v).map(([k, v]) => `${k}=${v}`).join(" ") || "every dead letter";
  const rows = [];
  for (const d of list.dead_letters) {
    const bodyRow = el("tr", { class: "sub", hidden: true }, el("td", { colspan: 13 }, el("pre", { class: "body" })));
    rows.push(el("tr", { dataset: { letterId: d.id } },
      el("td", {}, el("input", { type: "checkbox", class: "pick", value: d.id, "aria-label": `select ${d.id}` })),
      el("td", {}, String(d.id)), el("td", {}, d.reason), el("td", {}, d.topic), el("td", {}, d.channel || "–"),
      el("td", {}, traceLink(d.message_id)), el("td", { class: "num" }, fmt(d.attempts)), el("td", {}, when(d.dead_ms)),
      el("td", {}, d.replayed_ms ? ["replayed ", traceLink(d.replay_message_id)] : "–"), el("td", { class: "num" }, fmt(d.size)),
      el("td", { class: "key" }, d.key ?? "–"), el("td", { class: "num priority" }, String(d.priority)),
      el("td", {}, el("button", { type: "button", "data-action": "show", onclick: async () => {
        if (bodyRow.hidden) {
          const full = await api("GET", `dead-letters/${d.id}`);
          // the message's headers (kept with the letter, sent again by a replay), then its body
          const headers = Object.entries(full.headers || {}).map(([name, value]) => `${name}: ${value}\n`).join("");
          bodyRow.querySelector("pre").textContent = headers + (headers ? "\n" : "") + (full.body_encoding === "base64" ? "(base64) " : "") + full.body + (full.detail ? `\n\n— ${full.detail}` : "");
        }
        bodyRow.hidden = !bodyRow.hidden;
      } }, "show"))));
    rows.push(bodyRow);
  }
  const replaySelected = actionButton("Replay selected", async () => {
    const ids = selected();
    if (!ids.length) throw new ApiError(0, "E_INVALID", "select dead letters first");
    return `replayed ${(await api("POST", "dead-letters/replay", { ids: ids.join(",") })).replayed}`;
  }, { name: "replay-selected", confirm: () => `Replay the ${selected().length} selected dead letters to their channels?` });
  const deleteSelected = actionButton("Delete selected", async () => {
    const ids = selected();
    if (!ids.length) throw new ApiError(0, "E_INVALID", "select dead letters first");
    return `deleted ${(await api("POST", "dead-letters/delete", { ids: ids.join(",") })).deleted}`;
  }, { name: "delete-selected", danger: true, confirm: () => `Delete the ${selected().length} selected dead letters for good?` });
  const noFilter = !Object.values(filters).some((v) => v);
  const all = noFilter ? { all: "true" } : filters;
  const replayAll = actionButton(`Replay all ${count.unreplayed} matching`, async () =>
    `replayed ${(await api("POST", "dead-letters/replay", all)).replayed}`,
  { name: "replay-all", confirm: `Replay ${count.unreplayed} dead letters not yet replayed (${described}) to their channels?` });
  const deleteAll = actionButton(`Delete all ${count.matching} matching`, async () =>
    `deleted ${(await api("POST", "dead-letters/delete", all)).deleted}`,
  { name: "delete-all", danger: true, confirm: `Delete ${count.matching} dead letters (${described}) for good?` });
  fill(page, 
    el("h1", {}, "Dead letters"),
    form,
    el("p", { class: "muted" }, `${count.matching} match (${count.unreplayed} not replayed); showing the first ${list.dead_letters.length}. Every replay and delete is written to the audit log.`),
    el("div", { class: "actions" }, replaySelected, deleteSelected, replayAll, deleteAll),
    list.dead_letters.length
      ? el("table", { id: "dead-letters" }, el("thead", {}, el("tr", {}, ["", "Id", "Reason", "Topic", "Channel", "Message", "Attempts", "Dead at", "Replayed", "Bytes", "Key", "Priority", ""].map((t) => el("th", {}, t)))), el("tbody", {}, rows))
      : el("p", { class: "muted" }, "No dead letter matches."));
}

async function delayPage(page) {
  const params = new URLSearchParams(location.hash.split("?")[1] || "");
  const topic = params.get("topic") || "", width = params.get("width") || "1m";
  const [histogram, entries] = await Promise.all([api("GET", "delay/histogram", { topic, width }), api("GET", "delay/entries", { topic, limit: 100 })]);
  const buckets = histogram.buckets;
  const w = 720, h = 140, n = Math.max(buckets.length ? buckets[buckets.length - 1].from_ms - histogram.now_ms : 0, 0) / histogram.width_ms + 1;
  const max = Math.max(1, ...buckets.map((b) => b.count));
  const bw = Math.max(2, Math.min(40, (w - 20) / Math.max(n, 1)));
  const chart = svg("svg", { class: "bars", width: w, height: h + 20, viewBox: `0 ${-12} ${w} ${h + 32}`, id: "due-histogram" });
  for (const b of buckets) {
    const i = (b.from_ms - histogram.now_ms) / histogram.width_ms;
    const bh = Math.max(1, (b.count / max) * h);
    chart.append(svg("rect", { x: 10 + i * bw, y: h - bh, width: Math.max(1, bw - 1), height: bh }, svg("title", {}, `${b.count} due from ${when(b.from_ms)}`)));
    if (bw >= 14) chart.append(svg("text", { x: 10 + i * bw + 2, y: Math.max(10, h - bh - 3) }, String(b.count)));
  }
  chart.append(svg("text", { x: 10, y: h + 14 }, "now"), svg("text", { x: w - 160, y: h + 14 }, `each bar: ${width}; max ${max}`));
  const selected = () => [...page.querySelectorAll("input.pick:checked")].map((box) => box.value);
  const form = el("form", { class: "filters", onsubmit: (event) => {
    event.preventDefault();
    location.hash = "#/delay?" + new URLSearchParams({ topic: form.elements.topic.value.trim(), width: form.elements.width.value });
  } },
    el("label", {}, "topic", el("input", { name: "topic", value: topic })),
    el("label", {}, "bar width", el("select", { name: "width" }, ["10s", "1m", "10m", "1h", "1d"].map((v) => el("option", { value: v, selected: v === width }, v)))),
    el("button", { type: "submit" }, "Show"));
  fill(page, 
    el("h1", {}, "Delayed messages"), form,
    buckets.length ? chart : el("p", { class: "muted" }, "Nothing waiting."),
    el("div", { class: "actions" },
      actionButton("Deliver selected now", async () => `delivering ${(await api("POST", "delay/deliver-now", { ids: selected().join(",") })).changed.length} now`,
        { name: "deliver-now", confirm: () => `Deliver the ${selected().length} selected delayed messages now?` }),
      actionButton("Cancel selected", async () => `cancelled ${(await api("POST", "delay/cancel", { ids: selected().join(",") })).changed.length}`,
        { name: "cancel", danger: true, confirm: () => `Cancel the ${selected().length} selected delayed messages? They are deleted.` })),
    entries.delayed.length
      ? el("table", { id: "delayed" }, el("thead", {}, el("tr", {}, ["", "Delay id", "Topic", "Channel", "Due", "Producer", "Session", "Key", "Priority", "Headers", "Bytes", "Body"].map((t) => el("th", {}, t)))),
        el("tbody", {}, entries.delayed.map((d) => el("tr", { dataset: { delayId: d.delay_id } },
          el("td", {}, el("input", { type: "checkbox", class: "pick", value: d.delay_id })), el("td", {}, String(d.delay_id)), el("td", {}, d.topic),
          el("td", {}, d.channel || "every"), el("td", {}, when(d.due_ms)), el("td", {}, d.producer), el("td", {}, String(d.session_id)),
          propertyCells(d), el("td", { class: "num" }, fmt(d.size)), el("td", {}, el("code", {}, d.body_encoding === "utf-8" ? d.body.slice(0, 120) : "(binary)"))))))
      : "");
}

async function nodesPage(page) {
  const nodes = await api("GET", "nodes");
  fill(page, 
    el("h1", {}, "Nodes"),
    el("p", { class: "muted" }, nodes.cluster ? `From ZooKeeper (this node's session: ${nodes.zk_state}).` : "A single node (no --zk): the registry is PostgreSQL."),
    el("table", { id: "nodes" },
      el("thead", {}, el("tr", {}, ["Node", "TCP", "HTTP", "Version", "Started", "Heartbeat", "State"].map((t) => el("th", {}, t)))),
      el("tbody", {}, nodes.nodes.map((n) => el("tr", { dataset: { node: n.node_id } },
        el("td", {}, n.node_id, n.this ? el("span", { class: "muted" }, " (this node)") : ""),
        el("td", {}, n.tcp_address || "–"), el("td", {}, n.http_address || "–"), el("td", {}, n.version || "–"),
        el("td", {}, when(n.start_time * 1000)), el("td", {}, n.heartbeat_age == null ? "–" : `${n.heartbeat_age} s ago`),
        el("td", {}, el("span", { class: `badge ${n.health && n.health !== "OK" ? "bad" : "admin"}` }, n.health && n.health !== "OK" ? n.health : n.state)))))));
}

async function outboxesPage(page) {
  const { outboxes } = await api("GET", "outboxes");
  const pending = (o) => (o.pending == null ? "–" : fmt(o.pending) + (o.pending_at_least ? "+" : ""));
  fill(page,
    el("h1", {}, "Outboxes"),
    el("p", { class: "muted" }, "Application databases whose outbox this node relays (--outbox). Pending rows are counted "
      + "up to a bound (shown with +: at least that many); relayed and dead-lettered count rows since this node started."),
    outboxes.length
      ? el("table", { id: "outboxes" },
        el("thead", {}, el("tr", {}, ["Outbox", "Schema", "Database", "Relaying node", "Pending", "Oldest pending", "Relayed", "Dead letters", "Last cycle"].map((t) => el("th", {}, t)))),
        el("tbody", {}, outboxes.map((o) => el("tr", { dataset: { outbox: o.name } },
          el("td", {}, o.name), el("td", {}, o.schema), el("td", {}, o.database),
          el("td", { class: "relaying" }, o.relaying_node || "none", o.relaying ? el("span", { class: "muted" }, " (this node)") : ""),
          el("td", { class: "num pending" }, pending(o)), el("td", { class: "num oldest" }, o.pending ? age(o.oldest_pending_seconds) : "–"),
          el("td", { class: "num relayed" }, fmt(o.relayed)), el("td", { class: "num dead" }, fmt(o.dead_lettered)),
          el("td", { class: "num" }, o.last_cycle_seconds_ago == null ? "–" : `${age(o.last_cycle_seconds_ago)} ago`)))))
      : el("p", { id: "no-outboxes" }, "This node relays no outbox."));
}

const EVENT_TEXT = {
  stored: (e) => `stored by ${e.node_id || "?"} (producer ${e.producer || "?"}, session ${e.session_id ?? "?"})`,
  delivered: (e) => `delivered to ${e.channel} → ${e.consumer || "?"} (attempt ${e.attempt})`,
  returned: (e) => `came back from ${e.consumer || "?"} on ${e.channel}: ${{ timeout: "not acknowledged in time", consumer_gone: "the consumer went away", requeued: "the consumer gave it back (REQ)" }[e.reason] || e.reason}`,
  acked: (e) => `acknowledged on ${e.channel} by ${e.consumer || "?"} (after ${e.attempt} deliveries)`,
  dead_letter: (e) => `dead letter ${e.dead_letter_id} on ${e.channel || "its topic"}: ${e.reason} (${e.detail})`,
  replayed: (e) => `dead letter ${e.dead_letter_id} replayed as message ${e.replay_message_id ?? "(being stored)"}`,
};

async function tracePage(page, id) {
  const form = el("form", { class: "filters", id: "trace-form", onsubmit: (event) => {
    event.preventDefault();
    const value = form.elements.id.value.trim();
    if (value) location.hash = `#/trace/${enc(value)}`;
  } }, el("label", {}, "message id", el("input", { name: "id", value: id || "", inputmode: "numeric" })), el("button", { type: "submit" }, "Trace"));
  if (!id) {
    fill(page, el("h1", {}, "Message trace"), form, el("p", { class: "muted" }, "A message's life from the stored facts: stored, each delivery and why it came back, the ack or the dead letter."));
    return;
  }
  const t = await api("GET", `messages/${enc(id)}`);
  const facts = [];
  const stored = t.stored;
  if (stored) {
    facts.push(["topic", stored.topic], ["producer", stored.producer], ["session id", stored.session_id], ["stored at", when(stored.published_ms)],
      ["stored by", stored.node_id], ["produced at", when(stored.produced_ms)], ["bytes", fmt(stored.size)], ...propertyFacts(stored));
    if (stored.swept) facts.push(["note", "acknowledged everywhere and swept; kept for the archive"]);
  } else if (t.topic) {
    facts.push(["topic", t.topic], ["note", "the stored message was swept after its retention; these are the logged facts"]);
  }
  if (t.replay_of) facts.push(["replay of", `dead letter ${t.replay_of.dead_letter_id} (message ${t.replay_of.message_id ?? "–"}, ${t.replay_of.reason})`]);
  const pending = t.pending.map((p) => {
    const live = t.live[p.channel];
    return el("li", {}, `${p.channel}: not acknowledged yet, ${p.attempts} attempts recorded, owner ${p.owner || "?"}`,
      live ? ` — on this node ${live.state.replace("_", " ")}${live.consumer ? " to " + live.consumer : ""}${live.deadline_ms ? ", back at " + when(live.deadline_ms) + " unless acknowledged" : ""}` : "");
  });
  fill(page, 
    el("h1", {}, `Message ${t.message_id}`), form,
    t.delayed ? el("dl", { class: "facts", id: "trace-delayed" }, factRows([["delay entry", `waiting in the delay table for ${t.delayed.topic}, due ${when(t.delayed.due_ms)} (producer ${t.delayed.producer}, session ${t.delayed.session_id})`], ...propertyFacts(t.delayed)])) : "",
    el("dl", { class: "facts", id: "trace-facts" }, factRows(facts)),
    el("h2", {}, "What happened"),
    el("ol", { class: "timeline", id: "timeline" }, t.events.map((e) => el("li", { class: e.event, dataset: { event: e.event } }, el("span", { class: "when" }, when(e.at_ms)), (EVENT_TEXT[e.event] || ((x) => x.event))(e)))),
    pending.length ? [el("h2", {}, "Waiting"), el("ul", { id: "pending" }, pending)] : "",
    stored ? [el("h2", {}, "Body"), el("pre", { class: "body" }, (stored.body_encoding === "base64" ? "(base64) " : "") + stored.body + (stored.truncated ? "\n…" : ""))] : "");
}

async function auditPage(page) {
  const log = await api("GET", "audit", { limit: 100 });
  fill(page, el("h1", {}, "Audit log"),
    el("table", { id: "audit" }, el("thead", {}, el("tr", {}, ["When", "Surface", "Actor", "Operation", "Selection", "Affected"].map((t) => el("th", {}, t)))),
      el("tbody", {}, log.audit.map((a) => el("tr", {}, el("td", {}, when(a.at_ms)), el("td", {}, a.surface), el("td", {}, a.actor), el("td", {}, a.operation),
        el("td", {}, a.filters), el("td", { class: "num" }, fmt(a.affected)))))));
}

// -- the router -------------------------------------------------------------------------
const ROUTES = [
  [/^#?\/?$/, "topics", (p) => topicsPage(p), true],
  [/^#\/channel\/([^/]+)\/([^/]+)(?:\/after\/(\d+))?$/, "topics", (p, m) => channelPage(p, decodeURIComponent(m[1]), decodeURIComponent(m[2]), m[3]), true],
  [/^#\/dead-letters(\?.*)?$/, "dead-letters", (p) => deadLettersPage(p), false],
  [/^#\/delay(\?.*)?$/, "delay", (p) => delayPage(p), false],
  [/^#\/nodes$/, "nodes", (p) => nodesPage(p), true],
  [/^#\/outboxes$/, "outboxes", (p) => outboxesPage(p), true],
  [/^#\/trace(?:\/(.+))?$/, "trace", (p, m) => tracePage(p, m[1] && decodeURIComponent(m[1])), false],
  [/^#\/audit$/, "audit", (p) => auditPage(p), false],
];

// No refresh while a confirmation is open or a person types in one of the page's fields.
const busy = () => !!document.querySelector("dialog[open]") || !!document.activeElement?.closest("#page input, #page select");

let rendering = null;
async function render() {
  const hash = location.hash || "#/";
  const page = document.getElementById("page");
  clearTimeout(state.timer);
  for (const [pattern, nav, show, refresh] of ROUTES) {
    const match = hash.match(pattern);
    if (!match) continue;
    for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.dataset.nav === nav);
    const run = (rendering = show(page, match));
    try {
      await run;
      if (run === rendering) page.dataset.loaded = hash;  // tests wait for this
    } catch (error) {
      if (run === rendering) {
        fill(page, el("h1", {}, "Could not load this page"), el("p", { class: "error", id: "page-error" }, `${error.code || ""} ${error.message}`));
        page.dataset.loaded = hash;
      }
    }
    if (refresh && run === rendering) state.timer = setTimeout(function refreshed() { if (!busy()) render(); else state.timer = setTimeout(refreshed, REFRESH_MS); }, REFRESH_MS);
    return;
  }
  fill(page, el("h1", {}, "No such page"), el("p", {}, el("a", { href: "#/" }, "Topics")));
}

window.addEventListener("hashchange", () => { document.getElementById("status").replaceChildren(); render(); });
(async () => {
  try {
    const info = await fetch("/info", { cache: "no-store" }).then((r) => r.json());
    document.getElementById("node").textContent = info.node_id;
  } catch (e) { /* the page works without it */ }
  await whoami();
  render();
})();
