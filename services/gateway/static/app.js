/* The tenant dashboard of chat-engine: plain JavaScript, no build step, no network beyond the
 * gateway's own /v1 API (the Content-Security-Policy of the page allows nothing else).
 *
 * - The tenant API key lives in sessionStorage only (gone when the tab closes).
 * - Every form keeps a draft in sessionStorage on each keystroke until it is saved, so a reload
 *   loses nothing; the chat box keeps its transcript and unsent text the same way.
 * - API errors are problem+json; a `detail` ending in "- at `$.field`" is shown next to that field.
 * - Charts are inline SVG drawn here.
 */
'use strict';

// -- storage ----------------------------------------------------------------------------------

const S = {
  get(key, fallback = null) {
    const raw = sessionStorage.getItem(key);
    if (raw === null) return fallback;
    try { return JSON.parse(raw); } catch { return fallback; }
  },
  set(key, value) { sessionStorage.setItem(key, JSON.stringify(value)); },
  del(key) { sessionStorage.removeItem(key); },
};
const KEY = 'ce.apiKey';

// -- DOM helpers ------------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

const SVG_NS = 'http://www.w3.org/2000/svg';
function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

function setAttrs(el, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'text') el.textContent = v;
    else if (k === 'value') el.value = v;
    else if (k === 'checked') el.checked = !!v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

function clear(el) { while (el.firstChild) el.firstChild.remove(); return el; }

/** Scroll `el` to its end, now or, while it is not on the page yet, once it is (a view is built
 * before it is shown, and a frame may pass first). */
function scrollToEnd(el, frames = 600) {
  el.scrollTop = el.scrollHeight;
  if (!el.isConnected && frames > 0) requestAnimationFrame(() => scrollToEnd(el, frames - 1));
}

function toast(text, kind = 'ok') {
  const t = document.getElementById('toast');
  t.textContent = text;
  t.className = `show ${kind}`;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { t.className = ''; }, 4000);
}

const fmt = {
  pct: (x) => (x === null || x === undefined ? '—' : `${(x * 100).toFixed(x === 1 || x === 0 ? 0 : 1)}%`),
  ms: (x) => (x === null || x === undefined ? '—' : `${Math.round(x)} ms`),
  time: (iso) => (iso ? new Date(iso).toLocaleString() : '—'),
  ago(iso) {
    if (!iso) return '—';
    const sec = Math.round((Date.now() - new Date(iso).getTime()) / 1000);
    if (sec < 60) return `${Math.max(sec, 0)} s ago`;
    if (sec < 3600) return `${Math.round(sec / 60)} min ago`;
    if (sec < 86400) return `${Math.round(sec / 3600)} h ago`;
    return `${Math.round(sec / 86400)} d ago`;
  },
};

function json(value) { return JSON.stringify(value, null, 2); }

/** A stable, key-sorted JSON text: equal values give equal text (diffs, change detection). */
function canonical(value) {
  const sort = (v) => {
    if (Array.isArray(v)) return v.map(sort);
    if (v && typeof v === 'object') {
      return Object.fromEntries(Object.keys(v).sort().map((k) => [k, sort(v[k])]));
    }
    return v;
  };
  return JSON.stringify(sort(value), null, 2);
}

// -- the API ----------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, title, detail) {
    super(detail || title || `HTTP ${status}`);
    this.status = status;
    this.title = title;
    this.detail = detail || title || `HTTP ${status}`;
    this.field = fieldOf(this.detail);
  }
}

/** The body field a problem's detail points at ("… - at `$.webhook_url`" -> "webhook_url"). */
function fieldOf(detail) {
  const m = /at `\$\.([A-Za-z_][A-Za-z0-9_]*)/.exec(detail || '');
  return m ? m[1] : null;
}

function authHeaders(extra) {
  return { Authorization: `Bearer ${S.get(KEY, '')}`, ...extra };
}

async function problemOf(res) {
  let body = null;
  try { body = await res.json(); } catch { /* not JSON */ }
  return new ApiError(res.status, body && body.title, body && body.detail);
}

async function api(method, path, body, { key } = {}) {
  const headers = key ? { Authorization: `Bearer ${key}` } : authHeaders();
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  let res;
  try {
    res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (e) {
    throw new ApiError(0, 'Network error', `the gateway did not answer (${e.message}); check that it is running`);
  }
  if (res.status === 401 && !key) {
    S.del(KEY);
    route();
    throw new ApiError(401, 'Unauthorized', 'your API key was refused; sign in again');
  }
  if (!res.ok) throw await problemOf(res);
  if (res.status === 204) return null;
  return res.json();
}

/** Read an SSE response (fetch + ReadableStream: EventSource can neither POST nor send the key).
 * Calls onEvent(name, data, id) for each event; id is the last `id:` the stream gave, or null. */
async function readSSE(res, onEvent) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  let event = 'message';
  let data = [];
  let id = null;
  const dispatch = () => {
    if (data.length) {
      const text = data.join('\n');
      let parsed = text;
      try { parsed = JSON.parse(text); } catch { /* plain text data */ }
      onEvent(event, parsed, id);
    }
    event = 'message';
    data = [];
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buffer.indexOf('\n')) >= 0) {
      let line = buffer.slice(0, nl);
      buffer = buffer.slice(nl + 1);
      if (line.endsWith('\r')) line = line.slice(0, -1);
      if (line === '') dispatch();
      else if (line.startsWith(':')) continue; // comment / keep-alive
      else {
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? '' : line.slice(colon + 1);
        if (val.startsWith(' ')) val = val.slice(1);
        if (field === 'event') event = val;
        else if (field === 'data') data.push(val);
        else if (field === 'id') id = val;
      }
    }
  }
  dispatch();
}

// -- live streams -----------------------------------------------------------------------------

/** The live streams of the view on screen; route() closes them when the page shows another. */
const liveStreams = new Set();

function closeLiveStreams() {
  for (const stream of liveStreams) stream.close();
  liveStreams.clear();
}

/**
 * Follow a GET stream of server-sent events with fetch and a stream reader (EventSource cannot
 * send the key). Calls onEvent(name, data) for each event. When the connection drops it connects
 * again (backing off up to 5 s) sending `Last-Event-ID: lastId()`, so nothing is missed or given
 * twice. `onOpen()` runs (and is awaited) on every connection before its events are read;
 * `onState(text, live)` says whether the stream is connected. A refusal no retry changes (a 4xx
 * other than 429) ends it, saying why. Returns {close()}; leaving the view closes it too.
 */
function follow(path, { onEvent, lastId = () => null, onOpen = async () => {}, onState = () => {} }) {
  const token = renderToken;
  let controller = null;
  let closed = false;
  const stream = {
    close() { closed = true; liveStreams.delete(stream); if (controller) controller.abort(); },
  };
  liveStreams.add(stream);
  const over = () => closed || token !== renderToken;
  (async () => {
    let pause = 250;
    while (!over()) {
      controller = new AbortController();
      onState(null, false);
      try {
        const headers = authHeaders({ Accept: 'text/event-stream' });
        const last = lastId();
        if (last) headers['Last-Event-ID'] = String(last);
        const res = await fetch(path, { headers, signal: controller.signal, cache: 'no-store' });
        if (over()) { controller.abort(); return; }
        if (res.status === 401) { S.del(KEY); route(); return; }
        if (!res.ok) {
          const problem = await problemOf(res);
          onState(problem.detail, false);
          if (res.status < 500 && res.status !== 429) { stream.close(); return; }
        } else {
          pause = 250;
          await onOpen();
          if (over()) { controller.abort(); return; }
          onState('live', true);
          await readSSE(res, (name, data) => { if (!over()) onEvent(name, data); });
        }
      } catch (e) {
        if (over()) return;
        onState(`the live stream broke off (${e.message}); connecting again`, false);
      }
      if (over()) return;
      await new Promise((resolve) => { setTimeout(resolve, pause); });
      pause = Math.min(pause * 2, 5000);
    }
  })();
  return stream;
}

/** A badge saying whether a live stream is connected; `follow`'s onState keeps it current
 * (text null: connecting; otherwise why it is not connected, shown on hover). */
function liveBadge(id) {
  const badge = h('span', { class: 'badge off live-state', id, text: 'connecting…' });
  badge.set = (text, live) => {
    badge.textContent = live ? 'live' : text === null ? 'connecting…' : 'offline';
    badge.className = `badge ${live ? 'ok' : text === null ? 'off' : 'bad'} live-state`;
    badge.title = live ? 'what happens shows here as it is written' : text || '';
  };
  return badge;
}

// -- conversations as a session's event log tells them ----------------------------------------
//
// A session's stream (GET /v1/sessions/{id}/events) numbers its events (`seq`). A view keeps a
// list of entries: what the stream brought (with its seq) and what the page showed before the
// stream brought it (its own message, a streamed turn's reply, tool calls), each with the key
// the stream's event will carry. An event whose seq is known is skipped; one whose key matches an
// entry still waiting for its seq completes that entry; anything else is new.

/** The key an event and the entry a page made for it before it arrived share. */
function eventKey(type, d) {
  switch (type) {
    case 'message': return `message:${d.author}:${d.message_id}`;
    case 'tool_call': return `tool_call:${d.id}`;
    case 'tool_result': return `tool_result:${d.id}`;
    case 'approval_required': return `approval:${d.approval_id}`;
    case 'client_action': return `client_action:${d.call_id}`;
    case 'job_result': return `job_result:${d.job_id}`;
    case 'handoff': return `handoff:${d.state}:${d.handoff_id || ''}`;
    default: return `${type}:${d.seq}`;
  }
}

const AUTHOR_KIND = { contact: 'user', bot: 'bot', agent: 'agent' };

function handoffText(d) {
  if (d.state === 'requested') return 'handed off to a human';
  if (d.state === 'assigned') return `${d.agent || 'a person'} took the conversation`;
  return d.return_to_bot ? 'the team gave the conversation back to the bot' : 'the team closed the conversation';
}

/** The entry that shows an event of a session's stream. */
function entryOfEvent(type, d) {
  const key = eventKey(type, d);
  switch (type) {
    case 'message':
      return { kind: AUTHOR_KIND[d.author] || 'bot', text: d.text, agent: d.agent, message_id: d.message_id, key, final: true };
    case 'tool_call': return { kind: 'tool_call', name: d.name, key };
    case 'tool_result': return { kind: 'tool_result', name: d.name, success: d.success, key };
    case 'approval_required': return { kind: 'approval', approval_id: d.approval_id, summary: d.summary, key };
    case 'client_action': return { kind: 'client_action', text: `client action: ${JSON.stringify(d)}`, key };
    case 'job_result': return { kind: 'job_result', text: `workflow result: ${d.tool} ${d.status}`, key };
    case 'handoff': return { kind: 'handoff', state: d.state, text: handoffText(d), key };
    default: return { kind: type, text: type, key };
  }
}

/** Put event `d` of type `type` into `list`; false when the list has it already. */
function mergeEvent(list, type, d) {
  if (list.some((e) => e.seq === d.seq)) return false;
  const fresh = entryOfEvent(type, d);
  const waiting = list.find((e) => e.seq === undefined && e.key === fresh.key);
  if (!waiting) {
    list.push({ ...fresh, seq: d.seq });
    return true;
  }
  waiting.seq = d.seq;
  if (type === 'message') { waiting.text = d.text; waiting.final = true; }
  for (const [k, v] of Object.entries(fresh)) if (waiting[k] === undefined) waiting[k] = v;
  return true;
}

/** One entry of a conversation. `decide(entry, approve)` answers an approval when given. */
function bubble(e, decide) {
  if (e.kind === 'user') return h('div', { class: 'msg user', 'data-author': 'contact', text: e.text });
  if (e.kind === 'bot') return h('div', { class: 'msg bot', 'data-author': 'bot', text: e.text });
  if (e.kind === 'agent') {
    return h('div', { class: `msg agent${e.sending ? ' sending' : ''}`, 'data-author': 'agent' },
      h('span', { class: 'who', text: e.agent || 'agent' }), e.text);
  }
  if (e.kind === 'tool_call') return h('div', { class: 'event', 'data-event': 'tool_call', 'data-tool': e.name, text: `→ calling ${e.name}` });
  if (e.kind === 'tool_result') {
    const took = e.latency_ms === undefined ? '' : ` in ${e.latency_ms} ms`;
    return h('div', { class: `event ${e.success ? 'ok' : 'bad'}`, 'data-event': 'tool_result', 'data-tool': e.name,
      text: e.success ? `✓ ${e.name} answered${took}` : `✗ ${e.name} failed${e.error ? `: ${e.error}` : ''}` });
  }
  if (e.kind === 'approval') {
    const box = h('div', { class: 'event approval', 'data-event': 'approval_required' },
      h('p', { text: `Approval needed: ${(e.summary || []).join('; ')}` }));
    if (e.decided) box.append(h('p', { class: 'muted', text: e.decided }));
    else if (decide) {
      box.append(h('button', { type: 'button', class: 'small primary', text: 'Approve', onclick: () => decide(e, true) }), ' ',
        h('button', { type: 'button', class: 'small', text: 'Deny', onclick: () => decide(e, false) }));
    }
    return box;
  }
  if (e.kind === 'handoff') return h('div', { class: 'event handoff', 'data-event': 'handoff', 'data-state': e.state, text: e.text });
  if (e.kind === 'error') return h('div', { class: 'event bad', 'data-event': 'error', text: e.text });
  return h('div', { class: 'event', 'data-event': e.kind, text: e.text || e.kind });
}

// -- routing ----------------------------------------------------------------------------------

const main = () => document.getElementById('main');
let renderToken = 0;

const ROUTES = [
  [/^#\/tools\/new$/, () => toolFormView(null)],
  [/^#\/tools\/([^/]+)$/, (m) => toolFormView(decodeURIComponent(m[1]))],
  [/^#\/tools$/, () => toolsView()],
  [/^#\/contract$/, () => contractView()],
  [/^#\/analytics$/, () => analyticsView()],
  [/^#\/sessions\/([^/]+)$/, (m) => sessionsView(decodeURIComponent(m[1]))],
  [/^#\/sessions$/, () => sessionsView(null)],
  [/^#\/inbox$/, () => inboxView()],
  [/^#\/keys$/, () => keysView()],
];

async function route() {
  const token = ++renderToken;
  closeLiveStreams();
  const signedIn = !!S.get(KEY);
  document.getElementById('nav').hidden = !signedIn;
  document.getElementById('sign-out').hidden = !signedIn;
  if (!signedIn) { signInView(); return; }
  const hash = location.hash || '#/tools';
  const section = hash.split('/')[1] || 'tools';
  for (const a of document.querySelectorAll('#nav a')) {
    if (a.dataset.section === section) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
  for (const [re, view] of ROUTES) {
    const m = re.exec(hash);
    if (m) {
      const root = clear(main());
      root.append(h('p', { class: 'muted', text: 'Loading…' }));
      try {
        const content = await view(m);
        if (token !== renderToken) return; // a newer navigation won
        clear(root).append(content);
      } catch (e) {
        if (token !== renderToken) return;
        clear(root).append(h('div', { class: 'error-box', role: 'alert' }, h('strong', {}, e.title || 'Error'), ': ', e.detail || e.message));
      }
      return;
    }
  }
  location.hash = '#/tools';
}

function rerender() { route(); }

// -- sign-in ----------------------------------------------------------------------------------

function signInView() {
  const err = h('p', { class: 'field-error', id: 'err-api-key', role: 'alert' });
  const input = h('input', {
    id: 'api-key', name: 'api_key', type: 'password', autocomplete: 'off', required: true,
    'aria-describedby': 'err-api-key', placeholder: 'ce_…',
  });
  const form = h('form', { class: 'card narrow', id: 'sign-in' },
    h('h1', { text: 'Sign in' }),
    h('p', { class: 'muted', text: 'Use your tenant API key. It is kept in this browser tab only (session storage) and sent to this gateway alone.' }),
    h('label', { for: 'api-key', text: 'Tenant API key' }), input, err,
    h('button', { type: 'submit', class: 'primary', text: 'Sign in' }));
  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    err.textContent = '';
    const key = input.value.trim();
    if (!key) { err.textContent = 'enter the API key that `chat-engine tenant create` printed'; return; }
    try {
      await api('GET', '/v1/tools', undefined, { key });
    } catch (e) {
      err.textContent = e.detail;
      input.setAttribute('aria-invalid', 'true');
      input.focus();
      return;
    }
    S.set(KEY, key);
    if (!location.hash || location.hash === '#/') location.hash = '#/tools';
    else route();
  });
  const root = clear(main());
  root.append(form);
  input.focus();
}

document.getElementById('sign-out').addEventListener('click', () => {
  sessionStorage.clear(); // the key and every draft: nothing of this tenant stays in the tab
  location.hash = '';
  route();
});

// -- tools ------------------------------------------------------------------------------------

async function toolsView() {
  const [tools, stats] = await Promise.all([
    api('GET', '/v1/tools'),
    api('GET', '/v1/analytics/tools?since=24h').catch(() => ({ tools: [] })),
  ]);
  const byName = Object.fromEntries((stats.tools || []).map((t) => [t.name, t]));
  const rows = tools.tools.map((t) => {
    const st = byName[t.name];
    const toggle = h('button', {
      type: 'button', class: 'small', 'data-action': 'toggle', 'data-tool': t.name,
      text: t.enabled ? 'Disable' : 'Enable',
      onclick: async () => {
        toggle.disabled = true;
        try {
          await api('PATCH', `/v1/tools/${encodeURIComponent(t.name)}`, { enabled: !t.enabled });
          toast(`${t.name} ${t.enabled ? 'disabled' : 'enabled'}`);
          rerender();
        } catch (e) { toggle.disabled = false; toast(e.detail, 'bad'); }
      },
    });
    return h('tr', { 'data-tool': t.name },
      h('td', {}, h('a', { href: `#/tools/${encodeURIComponent(t.name)}`, text: t.name }),
        h('div', { class: 'muted small-text', text: t.description })),
      h('td', { text: t.type }),
      h('td', {}, h('span', { class: `badge ${t.enabled ? 'ok' : 'off'}`, 'data-field': 'enabled', text: t.enabled ? 'enabled' : 'disabled' })),
      h('td', { 'data-field': 'version', text: `v${t.version}` }),
      h('td', { 'data-field': 'success' }, st ? `${fmt.pct(st.success_rate)} of ${st.calls}` : h('span', { class: 'muted', text: 'no calls' })),
      h('td', {}, t.type === 'webhook' ? (t.auth_header_set ? 'set' : 'not set') : h('span', { class: 'muted', text: 'n/a' })),
      h('td', {}, toggle));
  });
  return h('section', {},
    h('div', { class: 'head-row' },
      h('h1', { text: 'Tools' }),
      h('a', { class: 'button primary', href: '#/tools/new', text: 'New tool' })),
    tools.tools.length
      ? h('table', { class: 'grid', id: 'tools-table' },
        h('thead', {}, h('tr', {}, ['Tool', 'Type', 'State', 'Version', 'Success (24 h)', 'Auth header', ''].map((c) => h('th', { text: c })))),
        h('tbody', {}, rows))
      : h('p', { class: 'empty', text: 'No tools yet. Register one with "New tool": a webhook your system answers.' }));
}

// The JSON-schema check run on every keystroke of the parameter editor. The server checks again
// on submit (and its 422 is shown next to the field); this catches mistakes while typing.
const JSON_TYPES = ['string', 'number', 'integer', 'boolean', 'array', 'object', 'null'];
const TYPE_ALTERNATIVES = ['anyOf', 'oneOf', 'allOf', 'enum', 'const', '$ref'];

function jsonErrorWithLine(text, e) {
  const m = /position (\d+)/.exec(e.message);
  if (!m || /line \d+/.test(e.message)) return e.message;
  const pos = Number(m[1]);
  const before = text.slice(0, pos).split('\n');
  return `${e.message} (line ${before.length}, column ${before[before.length - 1].length + 1})`;
}

function templateHoles(url) {
  return [...(url || '').matchAll(/\{([^}/]+)\}/g)].map((m) => m[1]);
}

/** Check the text of `parameters`. Returns {errors, warnings, props, required}. */
function checkParameters(text, holes = []) {
  const out = { errors: [], warnings: [], props: [], required: [] };
  if (!text.trim()) {
    if (holes.length) out.errors.push(`the URL uses {${holes[0]}}, so parameters must define '${holes[0]}'`);
    return out;
  }
  let value;
  try {
    value = JSON.parse(text);
  } catch (e) {
    out.errors.push(`not valid JSON: ${jsonErrorWithLine(text, e)}`);
    return out;
  }
  if (value === null || typeof value !== 'object' || Array.isArray(value)) {
    out.errors.push(`parameters must be a JSON object ({…}), not ${Array.isArray(value) ? 'an array' : value === null ? 'null' : `a ${typeof value}`}`);
    return out;
  }
  const keys = Object.keys(value);
  const full = value.type === 'object' && ('properties' in value || keys.every((k) => ['type', 'required', 'additionalProperties'].includes(k)));
  let props = value;
  const where = full ? '$.parameters.properties' : '$.parameters';
  if (full) {
    props = value.properties || {};
    if (props === null || typeof props !== 'object' || Array.isArray(props)) {
      out.errors.push('"properties" must be an object mapping each parameter name to its schema - at `$.parameters.properties`');
      return out;
    }
    if ('required' in value) {
      if (!Array.isArray(value.required) || value.required.some((r) => typeof r !== 'string')) {
        out.errors.push('"required" must be a list of parameter names such as ["order_id"] - at `$.parameters.required`');
      } else {
        for (const r of value.required) {
          if (!(r in props)) out.errors.push(`"required" names '${r}', which is not in "properties" - at \`$.parameters.required\``);
        }
        out.required = value.required.slice();
      }
    }
  } else if ('type' in value && typeof value.type === 'string') {
    out.errors.push('a full JSON schema needs "type": "object" and "properties"; for the short form, map each parameter name to its schema');
    return out;
  }
  for (const [name, p] of Object.entries(props)) {
    const at = `at \`${where}.${name}\``;
    if (p === null || typeof p !== 'object' || Array.isArray(p)) {
      out.errors.push(`'${name}' must be a schema object such as {"type": "string"} - ${at}`);
      continue;
    }
    if (!('type' in p) && !TYPE_ALTERNATIVES.some((k) => k in p)) {
      out.errors.push(`'${name}' needs a "type" (${JSON_TYPES.slice(0, 6).join(', ')}) - ${at}`);
    } else if ('type' in p) {
      const types = Array.isArray(p.type) ? p.type : [p.type];
      const bad = types.find((t) => !JSON_TYPES.includes(t));
      if (bad !== undefined) out.errors.push(`'${name}' has type ${JSON.stringify(bad)}; use one of ${JSON_TYPES.join(', ')} - ${at}`);
      if (types.includes('array') && 'items' in p && (p.items === null || typeof p.items !== 'object')) {
        out.errors.push(`'${name}'.items must be a schema object - ${at}.items`);
      }
      if (types.includes('object') && 'properties' in p && (p.properties === null || typeof p.properties !== 'object' || Array.isArray(p.properties))) {
        out.errors.push(`'${name}'.properties must be an object - ${at}.properties`);
      }
    }
    if ('required' in p) {
      if (full && typeof p.required === 'boolean') {
        out.errors.push(`'${name}' says "required": ${p.required}; in a full schema list required names in the top-level "required" - ${at}`);
      } else if (!full && p.required === true) {
        out.required.push(name);
      }
    }
    if ('enum' in p && !Array.isArray(p.enum)) out.errors.push(`'${name}'.enum must be a list - ${at}.enum`);
    if (!p.description) out.warnings.push(`'${name}' has no description; the model reads it to fill the value`);
    out.props.push({ name, type: Array.isArray(p.type) ? p.type.join(' | ') : (p.type || 'any'), description: p.description || '' });
  }
  for (const hole of holes) {
    if (!(hole in props)) out.errors.push(`the URL uses {${hole}} but parameters has no '${hole}' - add it`);
    else if (!out.required.includes(hole)) out.required.push(hole);
  }
  return out;
}

const TOOL_TYPES = ['webhook', 'backend_binding', 'workflow', 'python', 'client'];
const FAMILY_FIELDS = {
  webhook: ['webhook_url', 'method', 'auth_header'],
  backend_binding: ['path', 'method', 'parameter_map', 'scope'],
  workflow: ['start_url', 'handler'],
  python: ['handler'],
  client: [],
};
const LIST_FIELDS = ['intents', 'sensitive', 'protected', 'scope'];

/** The form's values as a tool body (the shape of POST /v1/tools), or throws {field, message}. */
function bodyFromValues(v) {
  const list = (x) => (x || '').split(',').map((p) => p.trim()).filter(Boolean);
  const body = {
    name: v.name.trim(), description: v.description, type: v.type,
    mutability: v.mutability, enabled: !!v.enabled,
    requires_approval: v.requires_approval === '' ? null : v.requires_approval === 'true',
    intents: list(v.intents), sensitive: list(v.sensitive), protected: list(v.protected),
    completes_variable: v.completes_variable.trim() || null, resource: v.resource.trim() || null,
  };
  const timeout = v.timeout_ms.trim();
  if (timeout) {
    if (!/^\d+$/.test(timeout)) throw { field: 'timeout_ms', message: 'timeout_ms must be a whole number of milliseconds' };
    body.timeout_ms = Number(timeout);
  } else body.timeout_ms = 5000;
  body.parameters = v.parameters.trim() ? JSON.parse(v.parameters) : {};
  const fam = FAMILY_FIELDS[v.type] || [];
  if (fam.includes('webhook_url')) body.webhook_url = v.webhook_url.trim();
  if (fam.includes('method') && v.method) body.method = v.method;
  if (fam.includes('path')) body.path = v.path.trim();
  if (fam.includes('parameter_map')) {
    let map = {};
    if (v.parameter_map.trim()) {
      try { map = JSON.parse(v.parameter_map); } catch (e) { throw { field: 'parameter_map', message: `not valid JSON: ${e.message}` }; }
    }
    body.parameter_map = map;
  }
  if (fam.includes('scope')) body.scope = list(v.scope);
  if (fam.includes('start_url') && v.start_url.trim()) body.start_url = v.start_url.trim();
  if (fam.includes('handler') && v.handler.trim()) body.handler = v.handler.trim();
  return body;
}

/** The form values that show a stored tool. */
function valuesFromTool(t) {
  const str = (x) => (x === null || x === undefined ? '' : String(x));
  return {
    name: t.name, description: t.description, type: t.type,
    webhook_url: str(t.webhook_url), method: str(t.method), auth_header: '', auth_header_clear: false,
    path: str(t.path), parameter_map: t.parameter_map && Object.keys(t.parameter_map).length ? json(t.parameter_map) : '',
    scope: (t.scope || []).join(', '), start_url: str(t.start_url), handler: str(t.handler),
    timeout_ms: str(t.timeout_ms ?? 5000), parameters: json(t.parameters || {}),
    mutability: t.mutability || 'read',
    requires_approval: t.requires_approval === null || t.requires_approval === undefined ? '' : String(t.requires_approval),
    enabled: t.enabled !== false, intents: (t.intents || []).join(', '), sensitive: (t.sensitive || []).join(', '),
    protected: (t.protected || []).join(', '), completes_variable: str(t.completes_variable), resource: str(t.resource),
    publish: true,
  };
}

const NEW_TOOL_VALUES = {
  name: '', description: '', type: 'webhook', webhook_url: '', method: '', auth_header: '', auth_header_clear: false,
  path: '', parameter_map: '', scope: '', start_url: '', handler: '', timeout_ms: '5000',
  parameters: json({ order_id: { type: 'string', description: 'The order number' } }),
  mutability: 'read', requires_approval: '', enabled: true, intents: '', sensitive: '', protected: '',
  completes_variable: '', resource: '', publish: true,
};

async function toolFormView(name) {
  const editing = name !== null;
  let tool = null;
  let versions = [];
  if (editing) {
    [tool, versions] = await Promise.all([
      api('GET', `/v1/tools/${encodeURIComponent(name)}`),
      api('GET', `/v1/tools/${encodeURIComponent(name)}/versions`).then((r) => r.versions),
    ]);
  }
  const draftKey = `ce.draft.tool.${editing ? name : '+new'}`;
  const base = editing ? valuesFromTool(tool) : { ...NEW_TOOL_VALUES };
  const draft = S.get(draftKey);
  const values = draft ? { ...base, ...draft.values } : { ...base };

  const controls = {};
  const errors = {};
  const fieldBox = {};
  const formError = h('div', { class: 'error-box', id: 'form-error', role: 'alert', hidden: true });

  function field(key, label, control, hint) {
    control.id = `f-${key}`;
    control.name = key;
    const err = h('p', { class: 'field-error', id: `err-${key}`, role: 'alert' });
    control.setAttribute('aria-describedby', `err-${key}${hint ? ` hint-${key}` : ''}`);
    controls[key] = control;
    errors[key] = err;
    const box = control.type === 'checkbox'
      ? h('div', { class: 'field check' }, control, h('label', { for: control.id, text: label }), err)
      : h('div', { class: 'field' }, h('label', { for: control.id, text: label }), control,
        hint ? h('p', { class: 'hint', id: `hint-${key}`, text: hint }) : null, err);
    fieldBox[key] = box;
    return box;
  }
  const input = (type = 'text', extra = {}) => h('input', { type, autocomplete: 'off', spellcheck: 'false', ...extra });
  const select = (options) => h('select', {}, options.map(([v, l]) => h('option', { value: v, text: l })));

  const paramsArea = h('textarea', { rows: 12, spellcheck: 'false', class: 'code' });
  const paramsStatus = h('div', { class: 'param-status', id: 'params-status', 'aria-live': 'polite' });
  const paramsPreview = h('div', { class: 'param-preview' });
  const authStatus = h('span', { class: `badge ${tool && tool.auth_header_set ? 'ok' : 'off'}`, id: 'auth-state', text: tool && tool.auth_header_set ? 'set' : 'not set' });

  const form = h('form', { id: 'tool-form', class: 'card', novalidate: true },
    formError,
    h('div', { class: 'cols' },
      h('div', {},
        field('name', 'Name', input('text', { readonly: editing }), 'letters, digits, _ or -, starting with a letter'),
        field('description', 'Description (the model reads it to decide when to call the tool)', h('textarea', { rows: 3 })),
        field('type', 'Type', select(TOOL_TYPES.map((t) => [t, t]))),
        field('webhook_url', 'Webhook URL', input('url', { placeholder: 'https://api.example.com/orders/{order_id}' }), '{param} holes are filled from the parameters'),
        field('path', 'Backend path', input('text', { placeholder: '/orders/{order_id}' })),
        field('method', 'HTTP method', select([['', 'default (GET for read, POST for write)'], ['GET', 'GET'], ['POST', 'POST'], ['PUT', 'PUT'], ['PATCH', 'PATCH'], ['DELETE', 'DELETE']])),
        h('div', { class: 'field', id: 'auth-box' },
          h('label', { for: 'f-auth_header' }, 'Auth header ', authStatus),
          (() => {
            const c = input('password', { placeholder: tool && tool.auth_header_set ? 'set — type to replace it' : 'e.g. Bearer sk_live_…', autocomplete: 'new-password' });
            c.id = 'f-auth_header'; c.name = 'auth_header'; controls.auth_header = c;
            c.setAttribute('aria-describedby', 'err-auth_header hint-auth_header');
            return c;
          })(),
          h('p', { class: 'hint', id: 'hint-auth_header', text: 'Write-only: stored encrypted, never shown again. Leave empty to keep it.' }),
          editing && tool.auth_header_set ? field('auth_header_clear', 'Remove the stored auth header', input('checkbox')) : null,
          (errors.auth_header = h('p', { class: 'field-error', id: 'err-auth_header', role: 'alert' }))),
        field('parameter_map', 'Parameter map (JSON: model name → backend name)', h('textarea', { rows: 3, class: 'code', spellcheck: 'false' })),
        field('scope', 'Scope (backend keys from trusted context, comma-separated)', input()),
        field('start_url', 'Start URL (your system runs the job)', input('url')),
        field('handler', 'Handler (registered in the engine)', input()),
        field('timeout_ms', 'Timeout (ms)', input('number', { min: 100, max: 60000, step: 100 }))),
      h('div', {},
        field('parameters', 'Parameters (JSON schema)', paramsArea,
          'A map of name → schema, or a full {"type": "object", "properties": …} schema. Checked as you type.'),
        paramsStatus, paramsPreview)),
    h('details', { class: 'more' },
      h('summary', { text: 'More settings' }),
      h('div', { class: 'cols' },
        h('div', {},
          field('mutability', 'Mutability', select([['read', 'read'], ['write', 'write']])),
          field('requires_approval', 'Requires approval', select([['', 'default (write tools only)'], ['true', 'always'], ['false', 'never']])),
          field('enabled', 'Enabled', input('checkbox'))),
        h('div', {},
          field('intents', 'Intents (comma-separated)', input()),
          field('sensitive', 'Sensitive parameters (redacted in logs)', input()),
          field('protected', 'Protected arguments (never from the model)', input()),
          field('completes_variable', 'Completes session variable', input()),
          field('resource', 'Shared resource (concurrency limit)', input())))),
    h('div', { class: 'actions' },
      editing ? field('publish', 'Publish this version now', input('checkbox')) : null,
      h('button', { type: 'submit', class: 'primary', id: 'save-tool', text: editing ? 'Save new version' : 'Create tool' }),
      h('button', { type: 'button', id: 'discard-draft', text: 'Discard draft', hidden: !draft,
        onclick: () => { S.del(draftKey); rerender(); } }),
      h('span', { class: 'muted', id: 'draft-state', text: draft ? `Draft restored (saved ${fmt.ago(draft.at)}).` : '' })));

  // fill the controls
  for (const [k, c] of Object.entries(controls)) {
    if (c.type === 'checkbox') c.checked = !!values[k];
    else c.value = values[k] ?? '';
  }
  if (editing) controls.type.disabled = true;

  function current() {
    const v = {};
    for (const [k, c] of Object.entries(controls)) v[k] = c.type === 'checkbox' ? c.checked : c.value;
    return v;
  }

  function showFamily() {
    const fam = FAMILY_FIELDS[controls.type.value] || [];
    for (const k of ['webhook_url', 'path', 'method', 'parameter_map', 'scope', 'start_url', 'handler']) {
      fieldBox[k].hidden = !fam.includes(k);
    }
    form.querySelector('#auth-box').hidden = !fam.includes('auth_header');
  }

  function holes() {
    const t = controls.type.value;
    return templateHoles(t === 'webhook' ? controls.webhook_url.value : t === 'backend_binding' ? controls.path.value : '');
  }

  function validateParams() {
    const r = checkParameters(paramsArea.value, holes());
    clear(paramsStatus);
    clear(paramsPreview);
    if (r.errors.length) paramsArea.setAttribute('aria-invalid', 'true'); else paramsArea.removeAttribute('aria-invalid');
    if (r.errors.length) {
      paramsStatus.className = 'param-status bad';
      paramsStatus.append(h('ul', {}, r.errors.map((e) => h('li', { text: e }))));
    } else {
      paramsStatus.className = 'param-status good';
      paramsStatus.append(h('p', { text: `Valid schema · ${r.props.length} parameter${r.props.length === 1 ? '' : 's'}` }));
      if (r.warnings.length) paramsStatus.append(h('ul', { class: 'warn' }, r.warnings.map((w) => h('li', { text: w }))));
      if (r.props.length) {
        paramsPreview.append(h('table', { class: 'grid compact' },
          h('thead', {}, h('tr', {}, ['Parameter', 'Type', 'Required', 'Description'].map((c) => h('th', { text: c })))),
          h('tbody', {}, r.props.map((p) => h('tr', {},
            h('td', { text: p.name }), h('td', { text: p.type }),
            h('td', { text: r.required.includes(p.name) ? 'yes' : '' }), h('td', { text: p.description }))))));
      }
    }
    return r;
  }

  function clearErrors() {
    formError.hidden = true;
    clear(formError);
    for (const [k, e] of Object.entries(errors)) {
      e.textContent = '';
      if (controls[k]) controls[k].removeAttribute('aria-invalid');
    }
  }

  function showError(fieldName, message) {
    if (fieldName && errors[fieldName] && !(fieldBox[fieldName] && fieldBox[fieldName].hidden)) {
      errors[fieldName].textContent = message;
      controls[fieldName].setAttribute('aria-invalid', 'true');
      const det = controls[fieldName].closest('details');
      if (det) det.open = true;
      controls[fieldName].focus();
    } else {
      formError.hidden = false;
      clear(formError).append(message);
    }
  }

  let saving = false;
  form.addEventListener('input', (ev) => {
    if (saving) return;
    // the auth header is write-only: never kept in the tab's storage, typed again after a reload
    const { auth_header: _secret, ...values } = current();
    S.set(draftKey, { values, at: new Date().toISOString(), version: tool ? tool.version : null });
    form.querySelector('#discard-draft').hidden = false;
    form.querySelector('#draft-state').textContent = 'Draft kept in this tab until saved.';
    const target = ev.target && ev.target.name;
    if (target && errors[target]) { errors[target].textContent = ''; controls[target].removeAttribute('aria-invalid'); }
    if (target === 'type') showFamily();
    if (['parameters', 'webhook_url', 'path', 'type'].includes(target)) validateParams();
  });

  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    clearErrors();
    const v = current();
    const check = validateParams();
    if (check.errors.length) {
      showError('parameters', 'fix the parameter schema first: ' + check.errors[0]);
      return;
    }
    let body;
    try {
      body = bodyFromValues(v);
    } catch (e) {
      showError(e.field, e.message);
      return;
    }
    const fam = FAMILY_FIELDS[v.type] || [];
    if (fam.includes('auth_header') && v.auth_header) body.auth_header = v.auth_header;
    const button = form.querySelector('#save-tool');
    button.disabled = true;
    saving = true;
    try {
      if (!editing) {
        await api('POST', '/v1/tools', body);
        S.del(draftKey);
        toast(`Created ${body.name}`);
        location.hash = `#/tools/${encodeURIComponent(body.name)}`;
      } else {
        const before = bodyFromValues(valuesFromTool(tool));
        const patch = {};
        for (const [k, val] of Object.entries(body)) {
          if (k === 'name' || k === 'type') continue;
          if (canonical(val) !== canonical(before[k])) patch[k] = val;
        }
        if (v.auth_header_clear) patch.auth_header = null;
        if (!Object.keys(patch).length) {
          showError(null, 'nothing changed: edit a field, then save');
          return;
        }
        patch.publish = !!v.publish;
        const saved = await api('PATCH', `/v1/tools/${encodeURIComponent(name)}`, patch);
        S.del(draftKey);
        toast(`Saved ${name} v${saved.version}${patch.publish ? ' (published)' : ' (not published)'}`);
        rerender();
      }
    } catch (e) {
      showError(e.field, e.detail);
    } finally {
      button.disabled = false;
      saving = false;
    }
  });

  showFamily();
  validateParams();

  const header = h('div', { class: 'head-row' },
    h('h1', {}, editing ? `Tool ${name}` : 'New tool',
      editing ? h('span', { class: `badge ${tool.enabled ? 'ok' : 'off'}`, text: tool.enabled ? 'enabled' : 'disabled' }) : null,
      editing ? h('span', { class: 'badge', text: `v${tool.version} published` }) : null),
    h('a', { href: '#/tools', text: '← all tools' }));
  const parts = [header];
  if (draft && editing && draft.version !== tool.version) {
    parts.push(h('div', { class: 'warn-box', text: `This draft was started on v${draft.version}; v${tool.version} is published now. Check the fields before saving.` }));
  }
  parts.push(form);
  if (editing) {
    parts.push(versionsPanel(name, versions));
    parts.push(h('div', { class: 'card danger' },
      h('h2', { text: 'Delete' }),
      h('p', { class: 'muted', text: 'Removes the tool and all its versions. Sessions stop being offered it at once.' }),
      h('button', { type: 'button', class: 'danger', text: `Delete ${name}`, onclick: async () => {
        if (!confirm(`Delete the tool ${name} and all its versions?`)) return;
        try {
          await api('DELETE', `/v1/tools/${encodeURIComponent(name)}`);
          S.del(draftKey);
          toast(`Deleted ${name}`);
          location.hash = '#/tools';
        } catch (e) { toast(e.detail, 'bad'); }
      } })));
  }
  return h('section', {}, parts);
}

// -- versions: diff and publish ---------------------------------------------------------------

/** Line diff of two texts (longest common subsequence): [{op: ' '|'-'|'+', line}]. */
function diffLines(a, b) {
  const x = a.split('\n');
  const y = b.split('\n');
  const n = x.length;
  const m = y.length;
  const lcs = Array.from({ length: n + 1 }, () => new Uint16Array(m + 1));
  for (let i = n - 1; i >= 0; i--) {
    for (let j = m - 1; j >= 0; j--) {
      lcs[i][j] = x[i] === y[j] ? lcs[i + 1][j + 1] + 1 : Math.max(lcs[i + 1][j], lcs[i][j + 1]);
    }
  }
  const out = [];
  let i = 0;
  let j = 0;
  while (i < n && j < m) {
    if (x[i] === y[j]) { out.push({ op: ' ', line: x[i] }); i++; j++; }
    else if (lcs[i + 1][j] >= lcs[i][j + 1]) out.push({ op: '-', line: x[i++] });
    else out.push({ op: '+', line: y[j++] });
  }
  while (i < n) out.push({ op: '-', line: x[i++] });
  while (j < m) out.push({ op: '+', line: y[j++] });
  return out;
}

function definitionText(v) {
  const { version, published, created_at: _c, ...rest } = v;
  return canonical(rest);
}

function versionsPanel(name, versions) {
  const newestFirst = versions.slice().reverse();
  const published = versions.find((v) => v.published) || versions[versions.length - 1];
  const latest = versions[versions.length - 1];
  // a chosen pair survives a reload, but not a new version: then the defaults show what changed
  const savedPair = S.get(`ce.diff.${name}`);
  const saved = savedPair && savedPair.latest === latest.version ? savedPair : {};
  const pick = (n, fallback) => (versions.some((v) => v.version === n) ? n : fallback);
  const option = (v) => h('option', { value: v.version, text: `v${v.version}${v.published ? ' (published)' : ''}` });
  const from = h('select', { id: 'diff-from', 'aria-label': 'Compare from version' }, newestFirst.map(option));
  const to = h('select', { id: 'diff-to', 'aria-label': 'Compare to version' }, newestFirst.map(option));
  const prev = versions.length > 1 ? versions[versions.length - 2].version : latest.version;
  // default: the published version against the newest, or the newest against the one before it
  from.value = pick(saved.from, published.version === latest.version ? prev : published.version);
  to.value = pick(saved.to, latest.version);
  const out = h('pre', { class: 'diff', id: 'version-diff' });

  function draw() {
    const a = versions.find((v) => v.version === Number(from.value));
    const b = versions.find((v) => v.version === Number(to.value));
    clear(out);
    const lines = diffLines(definitionText(a), definitionText(b));
    if (!lines.some((l) => l.op !== ' ')) { out.append(h('span', { class: 'muted', text: 'No differences.' })); return; }
    // show changes with two lines of context; fold the rest
    const keep = lines.map((l, i) => lines.slice(Math.max(0, i - 2), i + 3).some((c) => c.op !== ' '));
    let folded = false;
    lines.forEach((l, i) => {
      if (!keep[i]) {
        if (!folded) out.append(h('span', { class: 'fold', text: '  …\n' }));
        folded = true;
        return;
      }
      folded = false;
      out.append(h('span', { class: l.op === '+' ? 'add' : l.op === '-' ? 'del' : 'same', text: `${l.op} ${l.line}\n` }));
    });
  }
  const choose = () => { S.set(`ce.diff.${name}`, { from: Number(from.value), to: Number(to.value), latest: latest.version }); draw(); };
  from.addEventListener('change', choose);
  to.addEventListener('change', choose);
  draw();

  const rows = newestFirst.map((v) => h('tr', { 'data-version': v.version },
    h('td', { text: `v${v.version}` }),
    h('td', { text: fmt.time(v.created_at) }),
    h('td', {}, v.published ? h('span', { class: 'badge ok', text: 'published' }) : ''),
    h('td', { text: v.enabled === false ? 'disabled' : 'enabled' }),
    h('td', {}, v.published ? '' : h('button', {
      type: 'button', class: 'small', 'data-action': 'publish', 'data-version': v.version,
      text: v.version < published.version ? `Roll back to v${v.version}` : `Publish v${v.version}`,
      onclick: async (ev) => {
        ev.target.disabled = true;
        try {
          await api('POST', `/v1/tools/${encodeURIComponent(name)}/versions/${v.version}/publish`);
          toast(`Published ${name} v${v.version}`);
          rerender();
        } catch (e) { ev.target.disabled = false; toast(e.detail, 'bad'); }
      },
    }))));
  return h('div', { class: 'card', id: 'versions' },
    h('h2', { text: 'Versions' }),
    h('table', { class: 'grid compact' },
      h('thead', {}, h('tr', {}, ['Version', 'Created', '', 'State', ''].map((c) => h('th', { text: c })))),
      h('tbody', {}, rows)),
    h('div', { class: 'diff-head' }, 'Diff from ', from, ' to ', to),
    out);
}

// -- contract report --------------------------------------------------------------------------

async function contractView() {
  const report = await api('GET', '/v1/tools/contract');
  const withFindings = report.tools.filter((t) => t.findings.length);
  const clean = report.tools.filter((t) => !t.findings.length);
  const sev = (f) => (f.severity === 'error' ? 0 : 1);
  withFindings.sort((a, b) => Math.min(...a.findings.map(sev)) - Math.min(...b.findings.map(sev)) || (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
  const card = (t) => h('article', { class: 'card finding-card', 'data-tool': t.name },
    h('h2', {},
      t.origin === 'tenant' ? h('a', { href: `#/tools/${encodeURIComponent(t.name)}`, text: t.name }) : t.name,
      h('span', { class: 'badge', text: t.type }),
      t.version ? h('span', { class: 'badge', text: `v${t.version}` }) : null,
      h('span', { class: `badge ${t.offered ? 'ok' : 'off'}`, text: t.offered ? 'offered to the model' : 'never offered' })),
    h('p', { class: 'muted', text: t.runs ? `Runs: ${t.runs}` : 'Nothing runs for this tool.' }),
    h('ul', { class: 'findings' }, t.findings.map((f) => h('li', { class: `finding ${f.severity}`, 'data-kind': f.kind },
      h('span', { class: `badge ${f.severity === 'error' ? 'bad' : 'warn'}`, text: f.severity }),
      h('strong', { text: ` ${f.kind.replaceAll('_', ' ')}: ` }), f.message,
      h('div', { class: 'fix' }, h('strong', { text: 'Fix: ' }), f.fix)))),
    t.fields && t.fields.length ? h('details', {},
      h('summary', { text: 'Argument mapping' }),
      h('table', { class: 'grid compact' },
        h('thead', {}, h('tr', {}, ['Model', 'Backend', 'Source', 'Required by model', 'Required by backend'].map((c) => h('th', { text: c })))),
        h('tbody', {}, t.fields.map((f) => h('tr', {},
          h('td', { text: f.model_name ?? '—' }), h('td', { text: f.backend_name ?? '—' }), h('td', { text: f.source }),
          h('td', { text: f.required_by_model ? 'yes' : '' }), h('td', { text: f.required_by_backend ? 'yes' : '' })))))) : null);
  return h('section', {},
    h('div', { class: 'head-row' }, h('h1', { text: 'Tool-contract report' }),
      h('button', { type: 'button', onclick: rerender, text: 'Refresh' })),
    h('p', { class: report.ok ? 'good-box' : 'error-box', id: 'contract-summary' },
      report.ok ? `No errors. ${report.findings} finding${report.findings === 1 ? '' : 's'} in ${report.tools.length} tools.`
        : `${report.findings} finding${report.findings === 1 ? '' : 's'} across ${withFindings.length} tool${withFindings.length === 1 ? '' : 's'}; errors stop a tool from working as defined.`),
    withFindings.map(card),
    clean.length ? h('div', { class: 'card' }, h('h2', { text: 'No findings' }),
      h('p', {}, clean.map((t) => h('span', { class: 'chip', 'data-tool': t.name, text: `${t.name} (${t.origin})` })))) : null);
}

// -- analytics (SVG charts) -------------------------------------------------------------------

const PALETTE = ['#2563eb', '#16a34a', '#d97706', '#9333ea', '#dc2626', '#0891b2', '#64748b'];
const RANGES = [['1h', 'last hour'], ['24h', 'last 24 hours'], ['7d', 'last 7 days'], ['30d', 'last 30 days']];

function niceMax(v) {
  if (v <= 0) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  const n = v / p;
  return (n <= 1 ? 1 : n <= 2 ? 2 : n <= 5 ? 5 : 10) * p;
}

function callsChart(ts) {
  const W = 1000; const H = 260; const L = 44; const R = 10; const T = 10; const B = 28;
  const top = ts.tools.slice(0, PALETTE.length - 1);
  const rest = ts.tools.slice(PALETTE.length - 1);
  const series = top.map((t, i) => ({ name: t.name, calls: t.calls, color: PALETTE[i] }));
  if (rest.length) {
    series.push({ name: `${rest.length} other`, color: PALETTE[PALETTE.length - 1],
      calls: ts.buckets.map((_, i) => rest.reduce((a, t) => a + t.calls[i], 0)) });
  }
  const n = ts.buckets.length;
  const max = niceMax(Math.max(1, ...ts.total.calls));
  const bw = (W - L - R) / n;
  const y = (v) => T + (H - T - B) * (1 - v / max);
  const svg = s('svg', { viewBox: `0 0 ${W} ${H}`, class: 'chart', role: 'img', id: 'chart-calls',
    'aria-label': `Tool calls per ${Math.round(ts.bucket_seconds / 60)} minutes` });
  for (const frac of Number.isInteger(max / 2) ? [0, 0.5, 1] : [0, 1]) {
    const yy = y(max * frac);
    svg.append(s('line', { x1: L, x2: W - R, y1: yy, y2: yy, class: 'gridline' }),
      s('text', { x: L - 6, y: yy + 4, 'text-anchor': 'end', class: 'axis', text: String(Math.round(max * frac)) }));
  }
  const step = Math.max(1, Math.ceil(n / 6));
  const daily = ts.bucket_seconds >= 86400;
  ts.buckets.forEach((b, i) => {
    let base = 0;
    for (const se of series) {
      const v = se.calls[i];
      if (!v) continue;
      const rect = s('rect', { x: L + i * bw + 1, width: Math.max(1, bw - 2), y: y(base + v), height: y(base) - y(base + v),
        fill: se.color, 'data-tool': se.name, 'data-calls': v });
      rect.append(s('title', { text: `${se.name}: ${v} call${v === 1 ? '' : 's'} · ${fmt.time(b)}` }));
      svg.append(rect);
      base += v;
    }
    if (i % step === 0) {
      const d = new Date(b);
      // a daily bucket is a UTC day: labelled with its UTC date (local, it is the day before west of UTC)
      const label = daily ? `${d.getUTCMonth() + 1}/${d.getUTCDate()}` : d.toTimeString().slice(0, 5);
      svg.append(s('text', { x: L + i * bw + bw / 2, y: H - 10, 'text-anchor': 'middle', class: 'axis', text: label }));
    }
  });
  const legend = h('ul', { class: 'legend' }, series.map((se) => h('li', {},
    h('span', { class: `swatch c${PALETTE.indexOf(se.color)}` }), se.name)));
  return h('figure', { class: 'card chart-card' }, h('figcaption', { text: daily ? 'Calls per day (UTC days)' : 'Calls over time' }), svg, legend,
    ts.tools.length ? null : h('p', { class: 'muted', text: 'No tool calls in this range.' }));
}

function barChart({ id, title, rows, value, max, label, color, second }) {
  const W = 540; const row = 26; const L = 130; const R = 110; const T = 6;
  const H = T * 2 + row * Math.max(rows.length, 1);
  const svg = s('svg', { viewBox: `0 0 ${W} ${H}`, class: 'chart', role: 'img', id, 'aria-label': title });
  const x = (v) => L + (W - L - R) * (max ? Math.min(v / max, 1) : 0);
  rows.forEach((r, i) => {
    const yy = T + i * row;
    svg.append(s('text', { x: L - 8, y: yy + row / 2 + 4, 'text-anchor': 'end', class: 'axis', text: r.name.length > 18 ? `${r.name.slice(0, 17)}…` : r.name }));
    svg.append(s('rect', { x: L, y: yy + 4, width: W - L - R, height: row - 8, class: 'track' }));
    if (second) {
      const b2 = s('rect', { x: L, y: yy + 4, width: Math.max(0, x(second(r)) - L), height: row - 8, class: 'bar-light', 'data-tool': r.name });
      svg.append(b2);
    }
    const b = s('rect', { x: L, y: yy + 4, width: Math.max(0, x(value(r)) - L), height: row - 8, fill: color(r), 'data-tool': r.name });
    b.append(s('title', { text: `${r.name}: ${label(r)}` }));
    svg.append(b, s('text', { x: W - R + 8, y: yy + row / 2 + 4, class: 'axis', text: label(r) }));
  });
  if (!rows.length) svg.append(s('text', { x: L, y: T + row / 2 + 4, class: 'axis', text: 'no calls in this range' }));
  return h('figure', { class: 'card chart-card' }, h('figcaption', { text: title }), svg);
}

// -- API keys ---------------------------------------------------------------------------------

/** The tenant's API keys with their kind (admin: every route; chat: what a contact's page needs),
 * ids and dates only: a key is shown once, when the CLI makes it. */
async function keysView() {
  const { keys } = await api('GET', '/v1/keys');
  return h('section', {},
    h('div', { class: 'head-row' }, h('h1', { text: 'API keys' }),
      h('button', { type: 'button', onclick: rerender, text: 'Refresh' })),
    h('p', { class: 'muted', text: 'admin keys may use every route; chat keys only talk to sessions (messages, ' +
      'approvals, a session and its events), for a contact\'s web page. Make one with ' +
      '`chat-engine tenant add-key NAME --kind chat`.' }),
    h('table', { id: 'keys' },
      h('thead', {}, h('tr', {}, ['key id', 'kind', 'created', 'revoked'].map((t) => h('th', { text: t })))),
      h('tbody', {}, keys.map((k) => h('tr', { 'data-key': k.key_id },
        h('td', {}, h('code', { text: k.key_id })), h('td', { class: 'kind', text: k.kind }),
        h('td', { text: k.created_at }), h('td', { text: k.revoked_at || 'active' }))))));
}

async function analyticsView() {
  const since = S.get('ce.analytics.since', '24h');
  const [stats, ts] = await Promise.all([
    api('GET', `/v1/analytics/tools?since=${encodeURIComponent(since)}`),
    api('GET', `/v1/analytics/tools/timeseries?since=${encodeURIComponent(since)}`),
  ]);
  const range = h('select', { id: 'range', 'aria-label': 'Time range',
    onchange: (ev) => { S.set('ce.analytics.since', ev.target.value); rerender(); } },
  RANGES.map(([v, l]) => h('option', { value: v, text: l })));
  range.value = since;
  const tools = stats.tools;
  const maxP95 = niceMax(Math.max(1, ...tools.map((t) => t.p95_ms)));
  const byCalls = Object.fromEntries(tools.map((t) => [t.name, t.calls]));
  return h('section', {},
    h('div', { class: 'head-row' }, h('h1', { text: 'Analytics' }),
      h('div', {}, range, ' ', h('button', { type: 'button', onclick: rerender, text: 'Refresh' }))),
    callsChart(ts),
    h('div', { class: 'cols' },
      barChart({ id: 'chart-success', title: 'Success rate per tool', rows: tools, max: 1, value: (r) => r.success_rate,
        label: (r) => `${fmt.pct(r.success_rate)} of ${r.calls}`,
        color: (r) => (r.success_rate >= 0.95 ? '#16a34a' : r.success_rate >= 0.8 ? '#d97706' : '#dc2626') }),
      barChart({ id: 'chart-latency', title: 'Latency per tool (p50 dark, p95 light)', rows: tools, max: maxP95,
        value: (r) => r.p50_ms, second: (r) => r.p95_ms, label: (r) => `${fmt.ms(r.p50_ms)} · ${fmt.ms(r.p95_ms)}`,
        color: () => '#2563eb' })),
    h('div', { class: 'cols' },
      h('div', { class: 'card', id: 'most-used' }, h('h2', { text: 'Most used' }),
        stats.most_used.length ? h('ol', {}, stats.most_used.map((n) => h('li', { 'data-tool': n }, h('strong', { text: n }), ` — ${byCalls[n]} call${byCalls[n] === 1 ? '' : 's'}`)))
          : h('p', { class: 'muted', text: 'No calls in this range.' })),
      h('div', { class: 'card', id: 'never-used' }, h('h2', { text: 'Never used' }),
        stats.never_used.length ? h('ul', {}, stats.never_used.map((n) => h('li', { 'data-tool': n },
          h('a', { href: `#/tools/${encodeURIComponent(n)}`, text: n }))))
          : h('p', { class: 'muted', text: 'Every published tool was called in this range.' }))),
    h('div', { class: 'card' }, h('h2', { text: 'Per tool' }),
      h('table', { class: 'grid', id: 'analytics-table' },
        h('thead', {}, h('tr', {}, ['Tool', 'Calls', 'Success', 'p50', 'p95'].map((c) => h('th', { text: c })))),
        h('tbody', {}, tools.map((t) => h('tr', { 'data-tool': t.name },
          h('td', { text: t.name }), h('td', { 'data-field': 'calls', text: t.calls }), h('td', { text: fmt.pct(t.success_rate) }),
          h('td', { text: fmt.ms(t.p50_ms) }), h('td', { text: fmt.ms(t.p95_ms) })))))));
}

// -- sessions and the try-it chat -------------------------------------------------------------

function newSessionId() {
  const r = crypto.getRandomValues(new Uint32Array(1))[0].toString(36);
  return `try-${r}`;
}

async function sessionsView(selected) {
  const list = await api('GET', '/v1/sessions?limit=50');
  const parts = [h('div', { class: 'head-row' }, h('h1', { text: 'Sessions' }),
    h('button', { type: 'button', onclick: rerender, text: 'Refresh' }))];
  const table = list.sessions.length
    ? h('table', { class: 'grid', id: 'sessions-table' },
      h('thead', {}, h('tr', {}, ['Session', 'Messages', 'Handoff', 'Last activity'].map((c) => h('th', { text: c })))),
      h('tbody', {}, list.sessions.map((x) => h('tr', { 'data-session': x.session_id, class: x.session_id === selected ? 'selected' : null },
        h('td', {}, h('a', { href: `#/sessions/${encodeURIComponent(x.session_id)}`, text: x.session_id })),
        h('td', { text: x.messages }),
        h('td', {}, x.handoff ? h('span', { class: 'badge warn', text: 'handed off' }) : ''),
        h('td', { title: fmt.time(x.updated_at), text: fmt.ago(x.updated_at) })))))
    : h('p', { class: 'empty', text: 'No sessions yet. Start one with the chat box.' });
  const detail = h('div', { id: 'session-detail' });
  const tryIt = tryItBox(selected, () => { if (selected) loadSessionDetail(selected, detail); });
  parts.push(h('div', { class: 'cols wide-left' },
    h('div', {}, selected ? detail : null, h('div', { class: 'card' }, h('h2', { text: 'Recent sessions' }), table)),
    tryIt));
  if (selected) await loadSessionDetail(selected, detail);
  return h('section', {}, parts);
}

async function loadSessionDetail(id, box) {
  let view;
  let calls;
  try {
    [view, calls] = await Promise.all([
      api('GET', `/v1/sessions/${encodeURIComponent(id)}`),
      api('GET', `/v1/sessions/${encodeURIComponent(id)}/calls`).catch((e) => (e.status === 404 ? { turns: [] } : Promise.reject(e))),
    ]);
  } catch (e) {
    clear(box).append(h('div', { class: 'card' }, h('h2', { text: `Session ${id}` }), h('p', { class: 'error-box', text: e.detail })));
    return;
  }
  const vars = Object.entries(view.variables || {});
  clear(box).append(h('div', { class: 'card', 'data-session': id },
    h('h2', {}, `Session ${id} `,
      view.handoff ? h('span', { class: 'badge warn', id: 'handoff-state', text: 'handed off to a human' })
        : h('span', { class: 'badge ok', id: 'handoff-state', text: 'bot handling' })),
    h('p', { class: 'muted', text: `${view.messages} messages` }),
    h('div', { class: 'cols' },
      h('div', {}, h('h3', { text: 'Variables' }),
        vars.length ? h('table', { class: 'grid compact', id: 'session-variables' },
          h('tbody', {}, vars.map(([k, v]) => h('tr', {}, h('th', { text: k }), h('td', { text: v })))))
          : h('p', { class: 'muted', text: 'none' })),
      h('div', { id: 'open-breakers' }, h('h3', { text: 'Open breakers' }),
        view.open_breakers.length ? h('ul', {}, view.open_breakers.map((b) => h('li', {}, h('span', { class: 'badge bad', text: b }),
          ' failed repeatedly and is not offered again in this session')))
          : h('p', { class: 'muted', text: 'none' }))),
    h('h3', { text: 'Turns and tool calls' }),
    calls.turns.length ? h('ol', { class: 'turns', id: 'session-turns', reversed: true }, calls.turns.map((t) => h('li', { 'data-message': t.message_id },
      h('div', { class: 'turn-head' }, h('code', { text: t.message_id || '—' }), ' ', h('span', { class: 'muted', text: fmt.time(t.created_at) })),
      t.text ? h('p', { class: 'said user' }, h('strong', { text: 'User: ' }), t.text) : null,
      t.calls.length ? h('table', { class: 'grid compact calls' },
        h('thead', {}, h('tr', {}, ['Tool', 'Result', 'Latency', 'Parameters (redacted)'].map((c) => h('th', { text: c })))),
        h('tbody', {}, t.calls.map((c) => h('tr', { 'data-tool': c.name },
          h('td', { text: c.name }),
          h('td', {}, c.success ? h('span', { class: 'badge ok', text: 'ok' }) : h('span', { class: 'badge bad', title: c.error || '', text: 'failed' }),
            c.error ? h('div', { class: 'small-text', text: c.error }) : null),
          h('td', { text: fmt.ms(c.latency_ms) }),
          h('td', {}, h('pre', { class: 'code small', text: json(c.parameters) }))))))
        : h('p', { class: 'muted small-text', text: 'no tool calls' }),
      t.reply ? h('p', { class: 'said bot' }, h('strong', { text: 'Bot: ' }), t.reply) : null)))
      : h('p', { class: 'muted', text: 'No answered turns yet.' })));
}

const SESSION_ID = /^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$/;

const CONTACT_KEY = 'ce.tryit.contact';

/** Chat as a verified test contact: the gateway mints a token with the tenant's test key
 * (POST /v1/contact-tokens, admin keys only) for a `test:` contact with the claims given, kept in
 * the tab and sent as Contact-Token with each message and approval; minted again once expired. */
function testContact() {
  const held = S.get(CONTACT_KEY);
  const sub = h('input', { id: 'try-contact', type: 'text', autocomplete: 'off', placeholder: 'ann', value: held ? held.asked : '' });
  const claims = h('input', { id: 'try-claims', type: 'text', autocomplete: 'off', placeholder: '{"stay": "S-100"}',
    value: held && held.claims ? JSON.stringify(held.claims) : '' });
  const state = h('span', { id: 'try-contact-state', class: 'muted small-text' });
  const err = h('p', { class: 'field-error', id: 'err-try-contact', role: 'alert' });
  const show = () => {
    const c = S.get(CONTACT_KEY);
    clear(state).append(c ? h('span', { class: 'badge ok', text: `as ${c.sub}` }) : 'anonymous');
  };
  async function mint(asked, given) {
    const minted = await api('POST', '/v1/contact-tokens', { sub: asked, claims: given });
    S.set(CONTACT_KEY, { ...minted, asked, claims: given });
    show();
    return minted.token;
  }
  const signIn = h('button', { type: 'button', class: 'small', id: 'try-sign-in', text: 'Sign in',
    onclick: async () => {
      err.textContent = '';
      let given = {};
      try { given = claims.value.trim() ? JSON.parse(claims.value) : {}; } catch (e) { err.textContent = `claims: not valid JSON (${e.message})`; return; }
      if (!sub.value.trim()) { err.textContent = 'name the test contact first'; return; }
      try { await mint(sub.value.trim(), given); } catch (e) { err.textContent = e.detail || String(e); }
    } });
  const signOut = h('button', { type: 'button', class: 'small', id: 'try-sign-out', text: 'Sign out',
    onclick: () => { S.del(CONTACT_KEY); err.textContent = ''; show(); } });
  show();
  return {
    box: h('details', { class: 'test-contact', open: held ? true : null },
      h('summary', {}, 'Verified test contact ', state),
      h('p', { class: 'muted small-text', text: 'Send as a signed-in customer: the gateway mints a token for test:<name> with the claims your contact_verification maps (needs contact_verification in the bot config).' }),
      h('label', { for: 'try-contact', text: 'Name' }), sub,
      h('label', { for: 'try-claims', text: 'Claims (JSON)' }), claims,
      h('div', { class: 'actions' }, signIn, signOut), err),
    /** the Contact-Token header to send, minting a fresh token once the held one expired */
    async headers() {
      const c = S.get(CONTACT_KEY);
      if (!c) return {};
      const fresh = Date.parse(c.expires_at) - Date.now() > 30000 ? c.token : await mint(c.asked, c.claims || {});
      return { 'Contact-Token': fresh };
    },
  };
}

/** The try-it box: a contact's view of one session. It follows the session's stream, so every
 * message shows as it is written (the bot's, a person's from the Inbox, a reply to a job that
 * finished) without sending anything; a message sent here runs as a turn streamed over SSE, as an
 * anonymous contact or a verified test contact (testContact). */
function tryItBox(selected, afterTurn) {
  const sessionKey = 'ce.tryit.session';
  const sid = h('input', { id: 'try-session', type: 'text', autocomplete: 'off', spellcheck: 'false',
    value: selected || S.get(sessionKey) || newSessionId() });
  S.set(sessionKey, sid.value);
  const log = h('div', { class: 'chat-log', id: 'chat-log', 'aria-live': 'polite' });
  const text = h('textarea', { id: 'try-text', rows: 3, placeholder: 'where is my order 12345?', value: S.get('ce.tryit.text', '') });
  const err = h('p', { class: 'field-error', id: 'err-try-text', role: 'alert' });
  const send = h('button', { type: 'submit', class: 'primary', id: 'try-send', text: 'Send' });
  const live = liveBadge('try-live');
  const typing = h('div', { class: 'msg bot pending', id: 'typing', text: '…' });
  const contact = testContact();
  let busy = false;

  // the session on show: its entries and the number of the last event of its stream read
  const load = (id) => ({ id, list: S.get(`ce.tryit.log.${id}`, []), seq: S.get(`ce.tryit.seq.${id}`, 0) });
  let convo = load(sid.value);
  let watching = null;

  function save(c) {
    S.set(`ce.tryit.log.${c.id}`, c.list.slice(-100));
    S.set(`ce.tryit.seq.${c.id}`, c.seq);
  }

  function redraw() {
    clear(log).append(...convo.list.map((e) => bubble(e, decide)));
    if (busy) log.append(typing);
    scrollToEnd(log);
  }

  function watch() {
    if (watching) watching.close();
    watching = null;
    const c = convo;
    if (!SESSION_ID.test(c.id)) { live.set('not a session id', false); return; }
    watching = follow(`/v1/sessions/${encodeURIComponent(c.id)}/events`, {
      lastId: () => c.seq,
      onState: live.set,
      onEvent: (type, d) => {
        if (!d || typeof d !== 'object' || typeof d.seq !== 'number') return;
        const changed = mergeEvent(c.list, type, d);
        c.seq = Math.max(c.seq, d.seq);
        save(c);
        if (changed && c === convo) redraw();
      },
    });
  }

  function open(id) {
    convo = load(id);
    S.set(sessionKey, id);
    redraw();
    watch();
  }

  /** POST `body` to `url` as SSE (a turn of message `messageId`, when known) and show what
   * streams; true once it ran, or the problem when the API refused it before anything ran. */
  async function stream(url, body, messageId) {
    const c = convo;
    const list = c.list;
    const since = c.seq;
    // the session's stream may bring an event before this turn's own stream does: shown already
    const arrived = (key) => list.find((e) => e.key === key && e.seq > since);
    const add = (entry) => {
      const seen = arrived(entry.key);
      if (!seen) { list.push(entry); return; }
      for (const [k, v] of Object.entries(entry)) if (seen[k] === undefined) seen[k] = v;
    };
    const botKey = () => (messageId ? `message:bot:${messageId}` : null);
    let bot = null;
    const say = () => {
      if (bot && list.includes(bot)) return;
      bot = (messageId && arrived(botKey())) || { kind: 'bot', text: '', key: botKey(), message_id: messageId };
      if (!list.includes(bot)) list.push(bot);
    };
    const show = () => { save(c); if (c === convo) redraw(); };
    busy = true;
    show();
    let res;
    try {
      const as = await contact.headers();
      res = await fetch(url, { method: 'POST', headers: authHeaders({ 'Content-Type': 'application/json', Accept: 'text/event-stream', ...as }), body: JSON.stringify(body) });
    } catch (e) {
      if (e instanceof ApiError) {  // the test contact's token could not be minted again
        busy = false;
        show();
        return e;
      }
      busy = false;
      list.push({ kind: 'error', text: `the gateway did not answer (${e.message}); send again` });
      show();
      return true;
    }
    if (!res.ok) {
      busy = false;
      const p = await problemOf(res);
      show();
      return p;
    }
    try {
      await readSSE(res, (event, data) => {
        if (event === 'text') { say(); if (!bot.final) bot.text += data.text || ''; }
        else if (event === 'tool_call' || event === 'tool_result') {
          // text streamed before a tool round is its own bubble; the reply starts a new one
          if (bot && !bot.final && list.includes(bot)) list.splice(list.indexOf(bot), 1, { kind: 'bot', text: bot.text });
          bot = null;
          if (event === 'tool_call') add({ kind: 'tool_call', name: data.name, key: `tool_call:${data.id}` });
          else {
            add({ kind: 'tool_result', name: data.name, success: data.success, latency_ms: data.latency_ms,
              error: data.error, key: `tool_result:${data.id}` });
          }
        } else if (event === 'approval_required') {
          add({ kind: 'approval', approval_id: data.approval_id, summary: data.summary, message_id: messageId, key: `approval:${data.approval_id}` });
        } else if (event === 'client_action') add({ kind: 'client_action', text: `client action: ${JSON.stringify(data)}`, key: `client_action:${data.call_id}` });
        else if (event === 'job_result') add({ kind: 'job_result', text: `workflow result: ${JSON.stringify(data)}`, key: `job_result:${data.job_id}` });
        else if (event === 'error') list.push({ kind: 'error', text: data.detail || data.message || JSON.stringify(data) });
        else if (event === 'done') {
          if (data.reply) { say(); bot.text = data.reply; }
          if (bot && !messageId && data.message_id) {
            // an approval shown from the stream does not say its turn: the answer does
            messageId = data.message_id;
            const seen = arrived(botKey());
            if (seen && seen !== bot) list.splice(list.indexOf(bot), 1);
            else Object.assign(bot, { key: botKey(), message_id: messageId });
          }
        }
        show();
      });
    } catch (e) {
      list.push({ kind: 'error', text: `the stream broke off (${e.message}); the turn still completes and shows here once written` });
    }
    busy = false;
    show();
    return true;
  }

  async function decide(entry, approve) {
    const c = convo;
    const e = c.list.find((x) => x.kind === 'approval' && x.approval_id === entry.approval_id);
    if (e) e.decided = approve ? 'approved' : 'denied';
    save(c); redraw();
    const result = await stream(`/v1/sessions/${encodeURIComponent(c.id)}/approvals/${encodeURIComponent(entry.approval_id)}`, { approve }, entry.message_id);
    if (result !== true) { c.list.push({ kind: 'error', text: result.detail }); save(c); if (c === convo) redraw(); }
    afterTurn();
  }

  const form = h('form', { class: 'card try-it', id: 'try-it' },
    h('h2', {}, 'Try it ', live),
    h('p', { class: 'muted small-text', text: 'Chat as a contact would. Every message of the session shows here as it is written: the bot\'s, a person\'s from the Inbox. Lines like /call tool {"arg": 1} make the local model call exactly that tool; /handoff hands the session to a person.' }),
    contact.box,
    h('label', { for: 'try-session', text: 'Session' }),
    h('div', { class: 'row' }, sid,
      h('button', { type: 'button', class: 'small', text: 'New', onclick: () => { sid.value = newSessionId(); open(sid.value); } })),
    log,
    h('label', { for: 'try-text', text: 'Message' }), text, err,
    h('div', { class: 'actions' }, send,
      h('a', { href: '#', id: 'open-session', text: 'Open this session', onclick: (ev) => { ev.preventDefault(); location.hash = `#/sessions/${encodeURIComponent(sid.value)}`; } })));
  sid.addEventListener('change', () => open(sid.value.trim()));
  text.addEventListener('input', () => { S.set('ce.tryit.text', text.value); err.textContent = ''; text.removeAttribute('aria-invalid'); });
  text.addEventListener('keydown', (ev) => { if (ev.key === 'Enter' && (ev.ctrlKey || ev.metaKey)) form.requestSubmit(); });
  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const message = text.value;
    err.textContent = '';
    if (!message.trim()) { err.textContent = 'type a message first'; return; }
    const id = sid.value.trim();
    if (!SESSION_ID.test(id)) {
      err.textContent = 'the session id must be 1-128 letters, digits or . _ : @ - and start with a letter or digit';
      return;
    }
    if (id !== convo.id) open(id);
    const c = convo;
    send.disabled = true;
    const messageId = `dash-${crypto.randomUUID()}`;
    const mine = { kind: 'user', text: message, message_id: messageId, key: `message:contact:${messageId}` };
    c.list.push(mine);
    text.value = '';
    // cleared as the message leaves the box, not when its turn ends: whatever is typed while
    // the turn streams is the next draft and must survive a reload
    S.set('ce.tryit.text', '');
    let result;
    try {
      result = await stream(`/v1/sessions/${encodeURIComponent(id)}/messages`, { text: message, message_id: messageId }, messageId);
    } finally {
      send.disabled = false;
    }
    if (result !== true) {
      // refused before anything ran: take the message back into the box, say why next to it
      if (c.list.includes(mine)) c.list.splice(c.list.indexOf(mine), 1);
      save(c); redraw();
      if (!text.value) { text.value = message; S.set('ce.tryit.text', message); }
      err.textContent = result.detail;
      text.setAttribute('aria-invalid', 'true');
      return;
    }
    afterTurn();
    if (location.hash.startsWith('#/sessions') && location.hash !== `#/sessions/${encodeURIComponent(id)}`) {
      location.hash = `#/sessions/${encodeURIComponent(id)}`;
    }
  });
  redraw();
  watch();
  return form;
}

// -- inbox: the open handoffs, live -----------------------------------------------------------

const AGENT_KEY = 'ce.inbox.agent';
const HANDOFF_RANK = { requested: 0, assigned: 1, resolved: 2 };

/** The Inbox: open handoffs (requested and assigned) from GET /v1/handoffs, kept current by the
 * agents' feed (GET /v1/handoffs/events); the selected one's conversation follows its session's
 * stream. An agent claims it under the name entered once (kept in the tab), writes to the
 * contact, and resolves it back to the bot or closed. */
async function inboxView() {
  const rows = new Map(); // handoff id -> the handoff as GET /v1/handoffs shows it, plus `heard` and `unread`
  const gone = new Set(); // resolved while the view is open: a list read before must not bring them back
  let selected = S.get('ce.inbox.selected');
  let convo = null; // the selected handoff's conversation: {handoff, session_id, reason, list, seq, outcome, ...}

  const agent = h('input', { id: 'agent-name', type: 'text', autocomplete: 'name', spellcheck: 'false', value: S.get(AGENT_KEY, ''),
    placeholder: 'e.g. Ana', 'aria-describedby': 'err-agent-name' });
  const agentErr = h('p', { class: 'field-error', id: 'err-agent-name', role: 'alert' });
  agent.addEventListener('input', () => { S.set(AGENT_KEY, agent.value.trim()); agentErr.textContent = ''; agent.removeAttribute('aria-invalid'); });
  const live = liveBadge('inbox-live');
  const listErr = h('p', { class: 'field-error', id: 'err-inbox', role: 'alert' });
  const listBox = h('div', { id: 'inbox-list' });
  const panel = h('div', { class: 'card', id: 'inbox-conversation' });

  function take(handoffs) {
    for (const x of handoffs) {
      if (gone.has(x.id)) continue;
      if (x.state === 'resolved') { drop(x.id); continue; }
      const had = rows.get(x.id);
      if (had && HANDOFF_RANK[had.state] > HANDOFF_RANK[x.state]) continue; // read before a claim we heard of
      rows.set(x.id, { ...x, heard: had ? had.heard : [], unread: had ? had.unread : false });
    }
  }

  function drop(id) {
    rows.delete(id);
    gone.add(id);
  }

  function openRow(sessionId) {
    return [...rows.values()].find((x) => x.session_id === sessionId);
  }

  async function reload() {
    const lists = await Promise.all(['requested', 'assigned'].map((st) => api('GET', `/v1/handoffs?state=${st}`)));
    rows.clear();
    take(lists.flatMap((l) => l.handoffs));
    listErr.textContent = '';
    renderList();
    updatePanel();
  }

  async function fetchState(state) {
    try {
      take((await api('GET', `/v1/handoffs?state=${state}`)).handoffs);
      listErr.textContent = '';
    } catch (e) { listErr.textContent = e.detail; }
    renderList();
    updatePanel();
  }

  function onFeed(type, d) {
    if (type === 'handoff') {
      // a new handoff's event names its session only: its row comes from the list
      if (d.state === 'requested') { fetchState('requested'); return; }
      const row = (d.handoff_id && rows.get(d.handoff_id)) || openRow(d.session_id);
      if (d.state === 'resolved') {
        if (row) drop(row.id);
        if (d.handoff_id) gone.add(d.handoff_id);
        if (convo && convo.handoff === (d.handoff_id || (row && row.id)) && !convo.outcome) convo.outcome = d.return_to_bot ? 'back' : 'closed';
      } else if (d.state === 'assigned') {
        if (!row) { fetchState('assigned'); return; }
        row.state = 'assigned';
        row.agent = d.agent;
      }
      renderList();
      updatePanel();
    } else if (type === 'message') {
      const row = openRow(d.session_id);
      if (!row) return;
      row.heard.push({ author: d.author, agent: d.agent, text: d.text });
      if (d.author === 'contact' && row.id !== selected) row.unread = true;
      renderList();
    }
  }

  function lastSaid(x) {
    if (x.heard.length) {
      const m = x.heard[x.heard.length - 1];
      return `${m.author === 'contact' ? 'Contact' : m.author === 'agent' ? m.agent || 'Agent' : 'Bot'}: ${m.text}`;
    }
    const said = x.messages || [];
    const m = said[said.length - 1];
    return m ? `${m.role === 'user' ? 'Contact' : 'Team'}: ${m.text}` : '';
  }

  function stateBadge(state, agentName) {
    if (state === 'requested') return h('span', { class: 'badge warn', 'data-field': 'state', text: 'waiting' });
    if (state === 'assigned') return h('span', { class: 'badge ok', 'data-field': 'state', text: `with ${agentName}` });
    return h('span', { class: 'badge off', 'data-field': 'state', text: 'resolved' });
  }

  function renderList() {
    // waiting ones first, oldest first: a queue
    const open = [...rows.values()].sort((a, b) => HANDOFF_RANK[a.state] - HANDOFF_RANK[b.state]
      || (a.created_at < b.created_at ? -1 : a.created_at > b.created_at ? 1 : 0));
    clear(listBox);
    if (!open.length) {
      listBox.append(h('p', { class: 'empty', text: 'No open handoffs. A conversation shows up here the moment the bot hands it to a person.' }));
      return;
    }
    listBox.append(h('ul', { class: 'inbox-list' }, open.map((x) => h('li', {
      'data-handoff': x.id, 'data-session': x.session_id, 'data-state': x.state,
      class: `${x.id === selected ? 'selected' : ''}${x.unread ? ' unread' : ''}`,
    }, h('button', { type: 'button', class: 'inbox-item', 'aria-current': x.id === selected ? 'true' : null, onclick: () => select(x.id) },
      h('span', { class: 'inbox-head' }, h('strong', { text: x.session_id }), stateBadge(x.state, x.agent),
        x.unread ? h('span', { class: 'badge bad', text: 'new' }) : null,
        h('span', { class: 'muted small-text', title: fmt.time(x.created_at), text: fmt.ago(x.created_at) })),
      x.reason ? h('span', { class: 'small-text muted inbox-reason', text: x.reason }) : null,
      h('span', { class: 'inbox-last', 'data-field': 'last', text: lastSaid(x) }))))));
  }

  function select(id) {
    const row = rows.get(id);
    if (row) row.unread = false;
    if (selected !== id || !convo) {
      selected = id;
      S.set('ce.inbox.selected', id);
      openConversation(row);
    }
    renderList();
  }

  function openConversation(row) {
    if (convo && convo.stream) convo.stream.close();
    convo = null;
    clear(panel);
    if (!row) {
      panel.append(h('h2', { text: 'Conversation' }), h('p', { class: 'muted', text: 'Pick a handoff to read the conversation, claim it and answer the contact.' }));
      return;
    }
    const c = { handoff: row.id, session_id: row.session_id, list: [], seq: 0, outcome: null };
    convo = c;
    c.live = liveBadge('conv-live');
    c.state = h('span', { id: 'conv-state' });
    c.log = h('div', { class: 'chat-log agent-view', id: 'inbox-log', 'aria-live': 'polite' });
    c.err = h('p', { class: 'field-error', id: 'err-handoff', role: 'alert' });
    c.note = h('p', { class: 'good-box', id: 'conv-outcome', hidden: true });
    c.claim = h('button', { type: 'button', class: 'primary', id: 'claim', text: 'Claim', onclick: claim });
    c.back = h('button', { type: 'button', id: 'resolve-bot', text: 'Resolve: back to the bot', onclick: () => resolve(true) });
    c.close = h('button', { type: 'button', id: 'resolve-close', text: 'Resolve: close', onclick: () => resolve(false) });
    const draftKey = `ce.inbox.draft.${row.session_id}`;
    c.text = h('textarea', { id: 'reply-text', rows: 3, placeholder: 'Write to the contact…', value: S.get(draftKey, ''), 'aria-describedby': 'err-reply' });
    c.textErr = h('p', { class: 'field-error', id: 'err-reply', role: 'alert' });
    c.send = h('button', { type: 'submit', class: 'primary', id: 'reply-send', text: 'Send reply' });
    const form = h('form', { id: 'reply-form' }, h('label', { for: 'reply-text', text: 'Reply' }), c.text, c.textErr,
      h('div', { class: 'actions' }, c.send));
    c.text.addEventListener('input', () => { S.set(draftKey, c.text.value); c.textErr.textContent = ''; c.text.removeAttribute('aria-invalid'); });
    c.text.addEventListener('keydown', (ev) => { if (ev.key === 'Enter' && (ev.ctrlKey || ev.metaKey)) form.requestSubmit(); });
    form.addEventListener('submit', (ev) => { ev.preventDefault(); reply(c, draftKey); });
    panel.append(
      h('h2', {}, `Session ${row.session_id} `, c.state, c.live),
      row.reason ? h('p', { class: 'muted small-text', text: `Reason: ${row.reason}` }) : null,
      h('div', { class: 'actions' }, c.claim, c.back, c.close), c.err, c.note, c.log, form);
    c.stream = follow(`/v1/sessions/${encodeURIComponent(row.session_id)}/events`, {
      lastId: () => c.seq,
      onState: c.live.set,
      onEvent: (type, d) => {
        if (!d || typeof d !== 'object' || typeof d.seq !== 'number') return;
        c.seq = Math.max(c.seq, d.seq);
        // an agent reads the conversation and who has it; the bot's tool calls are left out
        if ((type === 'message' || type === 'handoff') && mergeEvent(c.list, type, d) && c === convo) drawLog();
      },
    });
    drawLog();
    updatePanel();
  }

  function drawLog() {
    const c = convo;
    clear(c.log).append(...c.list.map((e) => bubble(e)));
    scrollToEnd(c.log);
  }

  function updatePanel() {
    const c = convo;
    if (!c) return;
    const row = rows.get(c.handoff);
    const state = row ? row.state : 'resolved';
    clear(c.state).append(stateBadge(state, row && row.agent));
    c.claim.hidden = state !== 'requested';
    c.back.hidden = state === 'resolved';
    c.close.hidden = state === 'resolved';
    c.text.disabled = state === 'resolved';
    c.send.disabled = state === 'resolved';
    c.note.hidden = state !== 'resolved';
    c.note.textContent = c.outcome === 'back' ? 'Resolved: the bot answers this contact again.'
      : c.outcome === 'closed' ? 'Resolved: the conversation is closed.' : 'Resolved.';
  }

  function needName() {
    const name = agent.value.trim();
    if (!name) {
      agentErr.textContent = 'enter your name first: the contact sees it with your messages';
      agent.setAttribute('aria-invalid', 'true');
      agent.focus();
    }
    return name;
  }

  function refused(e, box, control) {
    if (e.field === 'agent') {
      agentErr.textContent = e.detail;
      agent.setAttribute('aria-invalid', 'true');
    } else {
      box.textContent = e.detail;
      if (control) control.setAttribute('aria-invalid', 'true');
    }
  }

  async function claim() {
    const c = convo;
    c.err.textContent = '';
    const name = needName();
    if (!name) return;
    c.claim.disabled = true;
    try {
      take([await api('POST', `/v1/handoffs/${encodeURIComponent(c.handoff)}/claim`, { agent: name })]);
    } catch (e) { refused(e, c.err); }
    c.claim.disabled = false;
    renderList();
    updatePanel();
  }

  async function resolve(back) {
    const c = convo;
    c.err.textContent = '';
    c.back.disabled = true;
    c.close.disabled = true;
    try {
      const x = await api('POST', `/v1/handoffs/${encodeURIComponent(c.handoff)}/resolve`, { return_to_bot: back });
      c.outcome = back ? 'back' : 'closed';
      take([x]);
    } catch (e) { refused(e, c.err); }
    c.back.disabled = false;
    c.close.disabled = false;
    renderList();
    updatePanel();
  }

  async function reply(c, draftKey) {
    c.textErr.textContent = '';
    const text = c.text.value;
    if (!text.trim()) { c.textErr.textContent = 'write a message first'; return; }
    const name = needName();
    if (!name) return;
    const messageId = `agent-${crypto.randomUUID()}`;
    const mine = { kind: 'agent', agent: name, text, message_id: messageId, key: `message:agent:${messageId}`, sending: true };
    c.list.push(mine);
    drawLog();
    c.text.value = '';
    S.del(draftKey);
    c.send.disabled = true;
    try {
      await api('POST', `/v1/sessions/${encodeURIComponent(c.session_id)}/agent-messages`, { text, agent: name, message_id: messageId });
      mine.sending = false;
    } catch (e) {
      // refused: the message goes back into the box, and why next to it
      if (c.list.includes(mine)) c.list.splice(c.list.indexOf(mine), 1);
      if (!c.text.value) { c.text.value = text; S.set(draftKey, text); }
      refused(e, c.textErr, c.text);
    }
    c.send.disabled = false;
    if (c === convo) { drawLog(); updatePanel(); }
  }

  await reload();
  openConversation(rows.get(selected));
  // the feed: on every connection the list is read again (what happened while not connected),
  // then each event moves it on; `reset` (events were missed) ends the stream, and it reconnects
  follow('/v1/handoffs/events', {
    onOpen: async () => { try { await reload(); } catch (e) { listErr.textContent = e.detail; } },
    onEvent: onFeed,
    onState: live.set,
  });
  return h('section', {},
    h('div', { class: 'head-row' }, h('h1', {}, 'Inbox ', live)),
    h('div', { class: 'cols inbox' },
      h('div', {},
        h('div', { class: 'card' },
          h('label', { for: 'agent-name', text: 'Your name (the contact sees it with your messages)' }), agent, agentErr),
        h('div', { class: 'card' }, h('h2', { text: 'Open handoffs' }), listErr, listBox)),
      panel));
}

window.addEventListener('hashchange', route);
route();
