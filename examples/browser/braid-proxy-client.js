// braid-proxy's own small Braid-HTTP subscription client for browsers.
// It is embedded in the binary (src/demo.rs) so that the demo page works
// with nothing installed. It speaks the subset the proxy emits
// (spec/braid-wire.md): GET with `Subscribe: true`, a 209 whose body is a
// series of updates, each an optional status line and a header block
// (`Version`, `Parents`, then `Content-Length` for a snapshot,
// `Content-Length` + `Content-Range` for one patch, or `Patches: N`
// followed by N patch blocks), separated by blank lines, which also serve
// as heartbeats. A broken or ended stream is resumed with `Parents` set to
// the last version received.
//
//   const sub = braidProxyClient.subscribe(url, {
//     onUpdate(update) {},   // {status, version, parents, body_text} or {..., patches}
//     onState(state, detail) {},  // 'connecting' | 'live' | 'reconnecting'
//   })
//   sub.close()
//
// braidProxyClient.applyPatches(text, patches) applies an update's patches.
;(function () {
  'use strict'

  const encoder = new TextEncoder()
  const decoder = new TextDecoder()

  // Index of the first CRLFCRLF (or LFLF) at or after `from`, and the
  // length of that terminator; null when the block is not complete yet.
  function blockEnd(buf, from) {
    for (let i = from; i < buf.length; i++) {
      if (buf[i] !== 10) continue
      if (buf[i + 1] === 10) return [i, 2]
      if (buf[i + 1] === 13 && buf[i + 2] === 10) return [i, 3]
    }
    return null
  }

  // Skips blank lines (between updates, or heartbeats).
  function skipBlank(buf, at) {
    while (at < buf.length && (buf[at] === 13 || buf[at] === 10)) at++
    return at
  }

  // Reads one header block at `at`: {status, headers, next} or null if
  // incomplete. Throws on a block that cannot be Braid.
  function readHead(buf, at) {
    const end = blockEnd(buf, at)
    if (!end) return null
    const lines = decoder.decode(buf.subarray(at, end[0])).split(/\r?\n/)
    const headers = {}
    let status = null
    for (const [i, line] of lines.entries()) {
      const m = /^HTTP\/\d(?:\.\d)? (\d{3})/.exec(line)
      if (i === 0 && m) {
        status = Number(m[1])
        continue
      }
      const colon = line.indexOf(':')
      if (colon <= 0) throw new Error('not a header line: ' + line.slice(0, 80))
      headers[line.slice(0, colon).trim().toLowerCase()] = line.slice(colon + 1).trim()
    }
    return { status, headers, next: end[0] + end[1] }
  }

  function contentLength(headers) {
    const n = Number(headers['content-length'])
    if (!Number.isSafeInteger(n) || n < 0) throw new Error('bad Content-Length: ' + headers['content-length'])
    return n
  }

  function patchOf(headers, content) {
    const m = /^(\w+)\s+(\[\d+:\d+\])$/.exec(headers['content-range'] ?? '')
    if (!m) throw new Error('bad Content-Range: ' + headers['content-range'])
    return { unit: m[1], range: m[2], content, content_text: decoder.decode(content) }
  }

  // `"a", "b"` -> ['a', 'b'] (each id is a JSON string literal).
  function versionList(value) {
    return value ? JSON.parse('[' + value + ']') : []
  }

  // Parses one update from `buf` at `at`: {update, next}, or null when
  // more bytes are needed.
  function parseUpdate(buf, at) {
    const head = readHead(buf, skipBlank(buf, at))
    if (!head) return null
    const h = head.headers
    const update = {
      status: head.status ?? 200,
      version: versionList(h['version']),
      parents: versionList(h['parents']),
    }
    let next = head.next
    if (h['patches'] !== undefined) {
      const count = Number(h['patches'])
      if (!Number.isSafeInteger(count) || count < 0) throw new Error('bad Patches: ' + h['patches'])
      update.patches = []
      for (let i = 0; i < count; i++) {
        const p = readHead(buf, skipBlank(buf, next))
        if (!p) return null
        const len = contentLength(p.headers)
        if (p.next + len > buf.length) return null
        update.patches.push(patchOf(p.headers, buf.slice(p.next, p.next + len)))
        next = p.next + len
      }
    } else {
      const len = contentLength(h)
      if (next + len > buf.length) return null
      const body = buf.slice(next, next + len)
      next += len
      if (h['content-range'] !== undefined) update.patches = [patchOf(h, body)]
      else {
        update.body = body
        update.body_text = decoder.decode(body)
      }
    }
    return { update, next }
  }

  function range(p) {
    const m = /\[(\d+):(\d+)\]/.exec(p.range)
    if (!m) throw new Error('unreadable range ' + p.range)
    return [Number(m[1]), Number(m[2])]
  }

  // Applies an update's patches to `doc` (a string). As braid-text does,
  // every range is absolute against the document before the update; they
  // are sorted by start and applied with a running offset. `text` ranges
  // count code points, `bytes` ranges UTF-8 bytes.
  function applyPatches(doc, patches) {
    const sorted = [...patches].sort((a, b) => range(a)[0] - range(b)[0])
    const units = new Set(sorted.map((p) => p.unit || 'text'))
    if (units.size > 1) throw new Error('mixed range units in one update')
    const bytes = units.has('bytes')
    let parts = bytes ? Array.from(encoder.encode(doc)) : Array.from(doc)
    let shift = 0
    for (const p of sorted) {
      const [s, e] = range(p)
      if (s > e || e + shift > parts.length) throw new Error('range ' + p.range + ' is outside the document')
      const content = p.content_text ?? ''
      const inserted = bytes ? Array.from(encoder.encode(content)) : Array.from(content)
      parts.splice(s + shift, e - s, ...inserted)
      shift += inserted.length - (e - s)
    }
    return bytes ? decoder.decode(new Uint8Array(parts)) : parts.join('')
  }

  function concat(a, b) {
    if (a.length === 0) return b
    const out = new Uint8Array(a.length + b.length)
    out.set(a)
    out.set(b, a.length)
    return out
  }

  // Opens a subscription to `url` and keeps it open until close():
  // every break is resumed with `Parents` = the last version received,
  // after 1 s, 2 s, ... (at most 10 s) of waiting.
  function subscribe(url, opts = {}) {
    const heartbeat = opts.heartbeats ?? 10
    const onUpdate = opts.onUpdate ?? (() => {})
    const onState = opts.onState ?? (() => {})
    let version = opts.parents ?? null
    let closed = false
    let controller = null
    let attempts = 0

    async function once() {
      controller = new AbortController()
      const headers = { Subscribe: 'true', Heartbeats: heartbeat + 's' }
      if (version && version.length) headers.Parents = version.map((v) => JSON.stringify(v)).join(', ')
      const res = await fetch(url, { headers, signal: controller.signal, cache: 'no-store' })
      if (res.status !== 209) {
        res.body?.cancel().catch(() => {})
        throw new Error('status ' + res.status + ' (expected 209)')
      }
      attempts = 0
      onState('live', res)
      const reader = res.body.getReader()
      // No byte for longer than the heartbeat allows: a dead connection.
      let silence = null
      const arm = () => {
        clearTimeout(silence)
        silence = setTimeout(() => controller.abort(), (heartbeat * 1.2 + 3) * 1000)
      }
      arm()
      let buf = new Uint8Array(0)
      try {
        for (;;) {
          const { value, done } = await reader.read()
          if (done) throw new Error('the stream ended')
          arm()
          buf = concat(buf, value)
          for (;;) {
            const parsed = parseUpdate(buf, 0)
            if (!parsed) break
            buf = buf.slice(parsed.next)
            if (parsed.update.version.length) version = parsed.update.version
            onUpdate(parsed.update)
          }
          buf = buf.slice(skipBlank(buf, 0))
        }
      } finally {
        clearTimeout(silence)
      }
    }

    ;(async () => {
      onState('connecting')
      while (!closed) {
        try {
          await once()
        } catch (e) {
          if (closed) return
          attempts++
          onState('reconnecting', String(e.message ?? e))
          await new Promise((resolve) => setTimeout(resolve, Math.min(attempts, 10) * 1000))
        }
      }
    })()

    return {
      close() {
        closed = true
        controller?.abort()
      },
      get version() {
        return version
      },
    }
  }

  window.braidProxyClient = { subscribe, applyPatches, parseUpdate }
})()
