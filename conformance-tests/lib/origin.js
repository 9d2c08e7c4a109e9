// A small plain REST origin (no Braid at all) that the proxy sits in front of.
//
//   GET/HEAD  path -> 200 body with Content-Type and (unless disabled) a strong
//                     ETag "v<N>"; If-None-Match matching -> 304; unknown -> 404
//   PUT       path -> stores the body (Content-Type from the request, else the
//                     previous one), assigns a new ETag, 201/200; an If-Match
//                     naming another ETag (or any, when there is none) -> 412
//   DELETE    path -> removes it (204), 404 afterwards
//
// Tests mutate it directly with set()/delete() (bypassing the proxy) and read
// the request log to count what the proxy asked for.

import http from 'node:http'

export async function startOrigin() {
  const resources = new Map() // path -> {body: Buffer, contentType, etag: string|null}
  const requests = [] // {method, path, headers, status, at}
  let counter = 0
  const nextEtag = () => `"v${++counter}"`

  function store(path, body, { contentType, etag } = {}) {
    const prev = resources.get(path)
    const useEtag = etag !== undefined ? etag !== false : prev ? prev.etag !== null : true
    const res = {
      body: Buffer.isBuffer(body) ? Buffer.from(body) : Buffer.from(String(body), 'utf8'),
      contentType: contentType ?? prev?.contentType ?? 'text/plain; charset=utf-8',
      etag: useEtag ? (typeof etag === 'string' ? etag : nextEtag()) : null,
    }
    resources.set(path, res)
    return res.etag
  }

  const server = http.createServer((req, res) => {
    const path = new URL(req.url, 'http://origin.invalid').pathname
    const entry = { method: req.method, path, headers: req.headers, status: 0, at: Date.now() }
    requests.push(entry)
    const reply = (status, headers = {}, body) => {
      entry.status = status
      res.writeHead(status, headers)
      res.end(body)
    }

    if (req.method === 'GET' || req.method === 'HEAD') {
      const r = resources.get(path)
      if (!r) return reply(404, { 'content-type': 'text/plain', 'content-length': 10 }, req.method === 'GET' ? 'not found\n' : undefined)
      const headers = { 'content-type': r.contentType, 'cache-control': 'no-cache' }
      if (r.etag) headers.etag = r.etag
      const inm = req.headers['if-none-match']
      if (r.etag && inm) {
        const tags = inm.split(',').map((t) => t.trim().replace(/^W\//, ''))
        if (tags.includes('*') || tags.includes(r.etag)) return reply(304, headers)
      }
      headers['content-length'] = r.body.length
      return reply(200, headers, req.method === 'GET' ? r.body : undefined)
    }

    if (req.method === 'PUT') {
      const chunks = []
      req.on('data', (c) => chunks.push(c))
      req.on('end', () => {
        const ifMatch = req.headers['if-match']
        if (ifMatch) {
          const etag = resources.get(path)?.etag
          const tags = ifMatch.split(',').map((t) => t.trim())
          if (!etag || !(tags.includes('*') || tags.includes(etag))) return reply(412, { 'content-length': 0 })
        }
        const existed = resources.has(path)
        const etag = store(path, Buffer.concat(chunks), {
          contentType: req.headers['content-type'] || undefined,
        })
        const headers = { 'content-length': 0 }
        if (etag) headers.etag = etag
        reply(existed ? 200 : 201, headers)
      })
      return
    }

    if (req.method === 'DELETE') {
      if (!resources.delete(path)) return reply(404, { 'content-length': 0 })
      return reply(204)
    }

    reply(405, { allow: 'GET, HEAD, PUT, DELETE', 'content-length': 0 })
  })
  server.keepAliveTimeout = 5000

  await new Promise((resolve, reject) => {
    server.once('error', reject)
    server.listen(0, '127.0.0.1', resolve)
  })
  const { port } = server.address()

  return {
    port,
    url: `http://127.0.0.1:${port}`,
    requests,

    /** Direct mutation (not through the proxy). Returns the new ETag or null. */
    set(path, body, opts) {
      return store(path, body, opts)
    },
    delete(path) {
      return resources.delete(path)
    },
    get(path) {
      return resources.get(path)
    },
    /** Current body as a string (utf8). */
    text(path) {
      return resources.get(path)?.body.toString('utf8')
    },
    /** Current ETag without quotes, i.e. the version the proxy must use. */
    version(path) {
      const e = resources.get(path)?.etag
      return e ? e.replace(/^"|"$/g, '') : null
    },
    /** Number of logged requests matching method and path (either optional). */
    count({ method, path } = {}) {
      return requests.filter((r) => (!method || r.method === method) && (!path || r.path === path)).length
    },
    async close() {
      server.closeAllConnections?.()
      await new Promise((resolve) => server.close(() => resolve()))
    },
  }
}
