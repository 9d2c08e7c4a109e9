// A raw-socket Braid subscriber: writes the HTTP/1.1 request by hand, parses
// the response head, de-chunks the body and parses the update stream itself.
// Used where the test must see the wire (framing, heartbeats) or control
// reading (a slow reader that stops reading its socket).

import net from 'node:net'
import { applyPatches } from './patch.js'
import { waitFor } from './util.js'

const CRLF2 = Buffer.from('\r\n\r\n')
const LF2 = Buffer.from('\n\n')

// Finds the end of a header block starting at `from`; returns
// {headEnd, bodyStart} or null if incomplete.
function findHeaderEnd(buf, from) {
  const a = buf.indexOf(CRLF2, from)
  const b = buf.indexOf(LF2, from)
  if (a < 0 && b < 0) return null
  if (a >= 0 && (b < 0 || a <= b)) return { headEnd: a, bodyStart: a + 4 }
  return { headEnd: b, bodyStart: b + 2 }
}

function parseHeaderLines(text) {
  const lines = text.split(/\r?\n/)
  let status = null
  let statusLine = null
  const m = /^HTTP\/?\S*\s+(\d{3})/.exec(lines[0])
  if (m) {
    status = Number(m[1])
    statusLine = lines.shift()
  }
  const headers = {}
  const order = []
  for (const line of lines) {
    const i = line.indexOf(':')
    if (i <= 0) throw new Error(`malformed header line ${JSON.stringify(line)}`)
    const name = line.slice(0, i).trim().toLowerCase()
    const value = line.slice(i + 1).trim()
    order.push(name)
    headers[name] = name in headers ? headers[name] + ', ' + value : value
  }
  return { status, statusLine, headers, order }
}

const parseList = (v) => (v == null ? undefined : JSON.parse('[' + v + ']'))

/**
 * Incremental parser for the decoded update stream (after de-chunking).
 * push(buf) returns the updates completed by this input:
 *   {status, statusLine, headers, order, version, parents, body?: Buffer,
 *    patches?: [{unit, range, content: Buffer, headers}]}
 */
export class UpdateParser {
  constructor() {
    this.buf = Buffer.alloc(0)
    this.pending = null // update whose headers are parsed
  }

  push(chunk) {
    this.buf = this.buf.length ? Buffer.concat([this.buf, chunk]) : Buffer.from(chunk)
    const out = []
    for (let guard = 0; guard < 1e6; guard++) {
      const u = this._step()
      if (!u) break
      out.push(u)
    }
    return out
  }

  _skipBlank() {
    let i = 0
    while (i < this.buf.length && (this.buf[i] === 13 || this.buf[i] === 10)) i++
    if (i) this.buf = this.buf.subarray(i)
  }

  _readHead() {
    this._skipBlank()
    if (!this.buf.length) return null
    const end = findHeaderEnd(this.buf, 0)
    if (!end) return null
    const text = this.buf.subarray(0, end.headEnd).toString('latin1')
    this.buf = this.buf.subarray(end.bodyStart)
    return parseHeaderLines(text)
  }

  _step() {
    if (!this.pending) {
      const head = this._readHead()
      if (!head) return null
      const u = {
        status: head.status,
        statusLine: head.statusLine,
        headers: head.headers,
        order: head.order,
        version: parseList(head.headers.version),
        parents: parseList(head.headers.parents),
      }
      if (head.headers.patches != null) {
        u.patchCount = Number(head.headers.patches)
        if (!Number.isInteger(u.patchCount) || u.patchCount < 0) throw new Error(`bad Patches: ${head.headers.patches}`)
        u.patches = []
      } else if (head.headers['content-length'] == null) {
        throw new Error(`update without Content-Length or Patches: ${JSON.stringify(head.headers)}`)
      }
      this.pending = u
    }
    const u = this.pending

    if (u.patches == null) {
      const len = Number(u.headers['content-length'])
      if (this.buf.length < len) return null
      const content = Buffer.from(this.buf.subarray(0, len))
      this.buf = this.buf.subarray(len)
      if (u.headers['content-range']) {
        const [unit, ...rest] = u.headers['content-range'].split(' ')
        u.patches = [{ unit, range: rest.join(' '), content, headers: u.headers }]
      } else u.body = content
      this.pending = null
      return u
    }

    while (u.patches.length < u.patchCount) {
      if (!u._patchHead) {
        const head = this._readHead()
        if (!head) return null
        if (head.headers['content-length'] == null || head.headers['content-range'] == null)
          throw new Error(`patch without Content-Length/Content-Range: ${JSON.stringify(head.headers)}`)
        u._patchHead = head
      }
      const len = Number(u._patchHead.headers['content-length'])
      if (this.buf.length < len) return null
      const [unit, ...rest] = u._patchHead.headers['content-range'].split(' ')
      u.patches.push({ unit, range: rest.join(' '), content: Buffer.from(this.buf.subarray(0, len)), headers: u._patchHead.headers })
      this.buf = this.buf.subarray(len)
      delete u._patchHead
    }
    this.pending = null
    return u
  }
}

/** Incremental HTTP/1.1 chunked transfer-coding decoder. */
export class ChunkedDecoder {
  constructor() {
    this.buf = Buffer.alloc(0)
    this.remaining = -1 // bytes left in the current chunk; -1 = expecting a size line
    this.needCrlf = false
    this.ended = false
  }

  push(chunk) {
    this.buf = this.buf.length ? Buffer.concat([this.buf, chunk]) : Buffer.from(chunk)
    const out = []
    for (let guard = 0; guard < 1e6 && !this.ended; guard++) {
      if (this.needCrlf) {
        if (this.buf.length < 2) break
        if (this.buf[0] !== 13 || this.buf[1] !== 10) throw new Error('chunked: missing CRLF after chunk data')
        this.buf = this.buf.subarray(2)
        this.needCrlf = false
      }
      if (this.remaining < 0) {
        const nl = this.buf.indexOf('\r\n')
        if (nl < 0) break
        const line = this.buf.subarray(0, nl).toString('latin1')
        const size = parseInt(line.split(';')[0].trim(), 16)
        if (!Number.isFinite(size)) throw new Error(`chunked: bad size line ${JSON.stringify(line)}`)
        this.buf = this.buf.subarray(nl + 2)
        if (size === 0) {
          this.ended = true
          break
        }
        this.remaining = size
      }
      if (!this.buf.length) break
      const n = Math.min(this.remaining, this.buf.length)
      out.push(Buffer.from(this.buf.subarray(0, n)))
      this.buf = this.buf.subarray(n)
      this.remaining -= n
      if (this.remaining === 0) {
        this.remaining = -1
        this.needCrlf = true
      }
    }
    return out.length ? Buffer.concat(out) : Buffer.alloc(0)
  }
}

/**
 * Opens a raw subscription: `GET path HTTP/1.1` with the given extra headers
 * (default Subscribe: true). Maintains a replica like lib/client.js does.
 */
export function rawSubscribe({ host = '127.0.0.1', port, path, headers = { Subscribe: 'true' }, initial, hostHeader } = {}) {
  const sock = net.connect({ host, port })
  const sub = {
    sock,
    head: null, // {statusLine, status, headers (lowercased, joined), rawHeaderLines}
    chunks: [], // {at, bytes} decoded body bytes as they arrive (after de-chunking)
    updates: [],
    errors: [],
    body: initial?.body != null ? Buffer.from(initial.body) : null,
    version: initial?.version ?? null,
    status: null,
    ended: false,
    bytesReceived: 0,

    get text() {
      return sub.body?.toString('utf8')
    },
    check() {
      if (sub.errors.length) throw sub.errors[0]
    },
    async waitForHead(timeoutMs = 10000) {
      await waitFor(() => {
        sub.check()
        if (sub.ended && !sub.head) throw new Error('connection closed before the response head')
        return sub.head
      }, timeoutMs, { message: 'response head' })
      return sub.head
    },
    async waitForVersion(v, timeoutMs = 10000) {
      await waitFor(() => {
        sub.check()
        if (sub.ended) throw new Error(`subscription ended while waiting for version ${v}`)
        return sub.version?.length === 1 && sub.version[0] === v
      }, timeoutMs, { message: () => `raw subscriber waiting for version ${v}, at ${JSON.stringify(sub.version)} after ${sub.updates.length} updates` })
    },
    async waitForUpdates(n, timeoutMs = 10000) {
      await waitFor(() => {
        sub.check()
        return sub.updates.length >= n
      }, timeoutMs, { message: () => `raw subscriber waiting for ${n} updates, got ${sub.updates.length}` })
    },
    close() {
      sub.ended = true
      sock.destroy()
    },
  }

  let headBuf = Buffer.alloc(0)
  let decoder = null // ChunkedDecoder or null for identity
  const parser = new UpdateParser()

  const onBody = (bytes) => {
    if (!bytes.length) return
    sub.chunks.push({ at: Date.now(), bytes })
    for (const u of parser.push(bytes)) {
      sub.updates.push(u)
      sub.status = u.status
      if (u.status && u.status !== 200) {
        sub.body = u.body ?? Buffer.alloc(0)
      } else if (u.patches) {
        if (sub.body == null) throw new Error('patches before any snapshot')
        if (u.parents && sub.version && u.parents.join('\n') !== sub.version.join('\n'))
          throw new Error(`update ${JSON.stringify(u.version)} has parents ${JSON.stringify(u.parents)} but the replica is at ${JSON.stringify(sub.version)}`)
        sub.body = applyPatches(sub.body, u.patches)
      } else sub.body = u.body
      if (u.version) sub.version = u.version
    }
  }

  sock.on('data', (data) => {
    sub.bytesReceived += data.length
    try {
      if (!sub.head) {
        headBuf = Buffer.concat([headBuf, data])
        const end = findHeaderEnd(headBuf, 0)
        if (!end) return
        const text = headBuf.subarray(0, end.headEnd).toString('latin1')
        const lines = text.split(/\r?\n/)
        const statusLine = lines.shift()
        const m = /^HTTP\/(\d\.\d) (\d{3})/.exec(statusLine)
        if (!m) throw new Error(`bad status line ${JSON.stringify(statusLine)}`)
        const hdrs = {}
        for (const l of lines) {
          const i = l.indexOf(':')
          const k = l.slice(0, i).trim().toLowerCase()
          const v = l.slice(i + 1).trim()
          hdrs[k] = k in hdrs ? hdrs[k] + ', ' + v : v
        }
        sub.head = { statusLine, httpVersion: m[1], status: Number(m[2]), headers: hdrs, rawHeaderLines: lines }
        if (/chunked/i.test(hdrs['transfer-encoding'] ?? '')) decoder = new ChunkedDecoder()
        const rest = headBuf.subarray(end.bodyStart)
        headBuf = null
        onBody(decoder ? decoder.push(rest) : rest)
      } else {
        onBody(decoder ? decoder.push(data) : data)
      }
    } catch (e) {
      sub.errors.push(e)
      sock.destroy()
    }
  })
  sock.on('error', (e) => {
    if (!sub.ended) sub.errors.push(e)
  })
  sock.on('close', () => {
    sub.ended = true
  })

  const lines = [`GET ${path} HTTP/1.1`, `Host: ${hostHeader ?? `${host}:${port}`}`]
  for (const [k, v] of Object.entries(headers)) lines.push(`${k}: ${v}`)
  sock.write(lines.join('\r\n') + '\r\n\r\n')
  return sub
}
