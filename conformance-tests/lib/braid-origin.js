// A Braid-native origin built on braid-http 1.3.80's own server side
// (`braidify`), for testing the proxy against an upstream that answers
// `Subscribe: true` with 209 instead of being polled.
//
//   GET + Subscribe  -> 209 via res.startSubscription(), then what the client
//                       lacks: a snapshot (no Parents), nothing (Parents =
//                       current), one update per missed version (Parents =
//                       a known older version), and for unknown Parents a
//                       snapshot or a plain status answer (`unknownParents`).
//                       Every later set() is pushed with res.sendUpdate().
//   GET              -> 200 with the body, Version and Content-Type (no ETag
//                       unless `etag: true`, so that a proxy which fell back
//                       to polling would show content-hash versions, not
//                       the origin's ids)
//
// The state is text only; patch ranges count code points. Tests drive it
// directly: set() stores a version and pushes it, dropSubscriptions() breaks
// the live streams, forgetHistory() makes old versions unknown, and
// `requests` logs what the proxy asked for.

import http from 'node:http'
import braidHttp from 'braid-http'
import { applyPatches } from './patch.js'

const braidify = braidHttp.http_server

// Reason phrases for the plain answers to unknown Parents.
const REASONS = { 309: 'Version Unknown Here', 404: 'Not Found', 410: 'Gone', 432: 'Version Not Found' }

/**
 * opts: {
 *   unknownParents: 'snapshot' (default) | a status code (309, 410, 432...):
 *     how a Subscribe whose Parents names an unknown version is answered,
 *   contentType: default Content-Type of new resources,
 *   etag: also send `ETag: "<version>"` on plain GETs (default false),
 * }
 */
export async function startBraidOrigin(opts = {}) {
  const unknownParents = opts.unknownParents ?? 'snapshot'
  if (unknownParents !== 'snapshot' && !(Number.isInteger(unknownParents) && unknownParents >= 300 && unknownParents < 600))
    throw new Error(`unknownParents must be 'snapshot' or a status code, not ${JSON.stringify(unknownParents)}`)
  const defaultType = opts.contentType ?? 'text/plain; charset=utf-8'

  // path -> {history: [{version, parents, body, patches|null}], contentType,
  //          subs: Set<{res, entry}>, counter}
  // history[i].patches turn history[i-1].body into history[i].body; null
  // means that step is sent as a snapshot.
  const resources = new Map()
  const requests = []

  const resource = (path) => {
    const r = resources.get(path)
    if (!r) throw new Error(`braid origin: no resource ${path}`)
    return r
  }
  const current = (r) => r.history.at(-1)

  // braid-http update objects (key order = header order on the wire).
  const snapshotUpdate = (step, withParents) => ({
    version: [step.version],
    ...(withParents && step.parents.length ? { parents: step.parents } : {}),
    body: step.body,
  })
  const stepUpdate = (step) =>
    step.patches
      ? { version: [step.version], parents: step.parents, patches: step.patches.map((p) => ({ ...p })) }
      : snapshotUpdate(step, true)

  function send(sub, update) {
    const { res } = sub
    if (res.destroyed || res.writableEnded) return
    res.sendUpdate(update)
  }

  function store(path, body, { version, patches, contentType, snapshot = false } = {}) {
    let r = resources.get(path)
    if (!r) {
      r = { history: [], contentType: contentType ?? defaultType, subs: new Set(), counter: 0 }
      resources.set(path, r)
    } else if (contentType) r.contentType = contentType
    const prev = current(r)
    r.counter++
    const id = version ?? `v${r.counter}`
    if (typeof id !== 'string' || !id) throw new Error(`braid origin: bad version ${JSON.stringify(id)}`)
    if (r.history.some((h) => h.version === id)) throw new Error(`braid origin: ${path} already has version ${id}`)

    // The test may give the body, the patches, or both (then they must agree).
    if (patches) {
      if (!prev) throw new Error(`braid origin: patches for ${path}, which has no previous version`)
      if (!Array.isArray(patches) || !patches.length) throw new Error('braid origin: patches must be a non-empty array')
      for (const p of patches) if (p.unit !== 'text') throw new Error(`braid origin: only text patches, got ${p.unit}`)
      const applied = applyPatches(prev.body, patches).toString('utf8')
      if (body == null) body = applied
      else if (applied !== String(body))
        throw new Error(`braid origin: patches turn ${JSON.stringify(prev.body)} into ${JSON.stringify(applied)}, not ${JSON.stringify(body)}`)
    }
    if (body == null) throw new Error('braid origin: set() needs a body or patches')
    body = String(body)

    const asText = (c) => (typeof c === 'string' ? c : Buffer.from(c).toString('utf8'))
    let stepPatches = null
    if (prev && !snapshot)
      stepPatches = patches ? patches.map((p) => ({ unit: 'text', range: p.range, content: asText(p.content) })) : simplePatch(prev.body, body)
    const step = { version: id, parents: prev ? [prev.version] : [], body, patches: stepPatches }
    r.history.push(step)

    const update = prev ? stepUpdate(step) : snapshotUpdate(step, false)
    for (const sub of r.subs) send(sub, update)
    return id
  }

  // Decides what a subscription with `parents` gets first: a list of
  // updates, or {status} for a plain refusal.
  function plan(r, parents) {
    const cur = current(r)
    if (!parents || !parents.length) return [snapshotUpdate(cur, false)]
    const at = parents.map((p) => r.history.findIndex((h) => h.version === p))
    if (at.some((i) => i < 0)) return unknownParents === 'snapshot' ? [snapshotUpdate(cur, false)] : { status: unknownParents }
    return r.history.slice(Math.max(...at) + 1).map(stepUpdate)
  }

  const server = http.createServer((req, res) => {
    const url = new URL(req.url, 'http://origin.invalid')
    const path = url.pathname
    const h = req.headers
    const entry = {
      method: req.method,
      path,
      subscribe: h.subscribe, // raw header values, undefined when absent
      parents: h.parents,
      parentsList: null, // parsed Parents, or null
      via: h.via,
      heartbeats: h.heartbeats,
      version: h.version,
      headers: { ...h },
      status: 0,
      at: Date.now(),
      closedAt: null, // when a subscription response closed
    }
    requests.push(entry)
    res.on('error', () => {}) // a destroyed subscription may still be written to
    const reply = (status, headers, body = '') => {
      entry.status = status
      res.writeHead(status, REASONS[status] ?? http.STATUS_CODES[status], { 'content-length': Buffer.byteLength(body), ...headers })
      res.end(req.method === 'HEAD' ? undefined : body)
    }

    try {
      braidify(req, res) // parses Version/Parents/Subscribe, adds startSubscription/sendUpdate
    } catch (e) {
      return reply(400, { 'content-type': 'text/plain' }, `bad Braid header: ${e.message}\n`)
    }
    entry.parentsList = req.parents || null

    if (req.method !== 'GET' && req.method !== 'HEAD') return reply(405, { allow: 'GET, HEAD' })
    const r = resources.get(path)
    if (!r || !r.history.length) return reply(404, { 'content-type': 'text/plain' }, 'not found\n')
    const cur = current(r)

    if (!req.subscribe) {
      const headers = { 'content-type': r.contentType, version: JSON.stringify(cur.version), 'cache-control': 'no-cache' }
      if (opts.etag) headers.etag = JSON.stringify(cur.version)
      return reply(200, headers, cur.body)
    }

    const first = plan(r, req.parents)
    if (!Array.isArray(first)) return reply(first.status, { 'content-type': 'text/plain' }, `unknown version in Parents: ${h.parents}\n`)

    // braidify 1.3.80 runs its own heartbeat loop when the request has a
    // Heartbeats header, but that timer never stops (it outlives the
    // response and keeps Node alive), so hide the header from it and send
    // the blank lines here instead.
    const heartbeats = h.heartbeats
    const beat = parseFloat(heartbeats)
    delete req.headers.heartbeats
    const sub = { res, entry }
    let timer = null
    res.startSubscription({
      onClose: () => {
        r.subs.delete(sub)
        clearInterval(timer)
        entry.closedAt = Date.now()
      },
    })
    entry.status = 209
    res.setHeader('content-type', r.contentType)
    if (Number.isFinite(beat) && beat > 0) {
      res.setHeader('heartbeats', heartbeats)
      timer = setInterval(() => res.destroyed || res.writableEnded || res.write('\r\n'), Math.max(50, beat * 1000))
      timer.unref()
    }
    // startSubscription does not send the head; without this, a subscriber
    // that is up to date would see no response until the next change.
    res.flushHeaders()
    for (const u of first) send(sub, u)
    r.subs.add(sub)
  })
  server.keepAliveTimeout = 5000

  await new Promise((resolve, reject) => {
    server.once('error', reject)
    server.listen(0, '127.0.0.1', resolve)
  })
  const { port } = server.address()

  const origin = {
    port,
    url: `http://127.0.0.1:${port}`,
    requests,
    unknownParents,

    /**
     * Stores a new version of `path` and pushes it to its live subscribers.
     * opts: {version = "v<n>", patches: [{unit: 'text', range: '[a:b]',
     * content}] (else one prefix/suffix patch is computed), snapshot: true
     * (push a full body with Parents instead of patches), contentType}.
     * `body` may be null when patches are given. Returns the version id.
     */
    set(path, body, opts) {
      return store(path, body, opts)
    },
    /** Forgets every version of `path` but the current one. */
    forgetHistory(path) {
      const r = resource(path)
      r.history = [current(r)]
    },
    /**
     * Breaks every live subscription to `path` (all paths without one):
     * how = 'destroy' (reset the connection, default) or 'end' (a clean end
     * of the chunked body). Returns how many were dropped.
     */
    dropSubscriptions(path, { how = 'destroy' } = {}) {
      let n = 0
      for (const [p, r] of resources) {
        if (path && p !== path) continue
        for (const sub of r.subs) {
          r.subs.delete(sub) // at once: a set() in the same tick must not reach it
          if (how === 'end') sub.res.end()
          else sub.res.destroy()
          n++
        }
      }
      return n
    },
    /** Number of open subscriptions to `path`. */
    liveSubscriptions(path) {
      return resources.get(path)?.subs.size ?? 0
    },
    /** The logged GETs with a Subscribe header for `path`, in order. */
    subscribeRequests(path) {
      return requests.filter((e) => e.method === 'GET' && e.path === path && e.subscribe !== undefined)
    },
    /** The logged GETs without a Subscribe header for `path`. */
    plainGets(path) {
      return requests.filter((e) => e.method === 'GET' && e.path === path && e.subscribe === undefined)
    },
    text(path) {
      return resources.get(path) && current(resource(path)).body
    },
    version(path) {
      return resources.get(path) ? current(resource(path)).version : null
    },
    /** [{version, parents, body}] still known for `path`, oldest first. */
    history(path) {
      return resource(path).history.map(({ version, parents, body }) => ({ version, parents, body }))
    },
    /** The body of `path` at `version`, if still known. */
    bodyAt(path, version) {
      return resource(path).history.find((h) => h.version === version)?.body
    },
    async close() {
      origin.dropSubscriptions()
      server.closeAllConnections?.()
      await new Promise((resolve) => server.close(() => resolve()))
    },
  }
  return origin
}

// One patch replacing what lies between the common prefix and suffix of
// `a` and `b`, in code points.
export function simplePatch(a, b) {
  const x = Array.from(a)
  const y = Array.from(b)
  let pre = 0
  while (pre < x.length && pre < y.length && x[pre] === y[pre]) pre++
  let suf = 0
  while (suf < x.length - pre && suf < y.length - pre && x[x.length - 1 - suf] === y[y.length - 1 - suf]) suf++
  return [{ unit: 'text', range: `[${pre}:${x.length - suf}]`, content: y.slice(pre, y.length - suf).join('') }]
}
