// 10. Wire framing seen from a raw socket, malformed Braid headers, and the
// plain (non-subscription) GET.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { useProxy, withSubs } from '../lib/harness.js'
import { rawSubscribe } from '../lib/raw.js'
import { request } from '../lib/proxy.js'

const PATH = '/doc'
const BODY = 'framing ✔ 🧪\n'
const ctx = useProxy({ seed: (o) => o.set(PATH, BODY, { contentType: 'text/plain; charset=utf-8' }) })

test('subscription response head and first update framing', async () => {
  const { origin, proxy } = ctx
  await withSubs(async (subs) => {
    const raw = rawSubscribe({ port: proxy.port, path: PATH, headers: { Subscribe: 'true' } })
    subs.push(raw)
    const head = await raw.waitForHead()
    assert.match(head.statusLine, /^HTTP\/1\.1 209\b/, `status line ${head.statusLine}`)
    assert.equal(head.headers['content-length'], undefined, 'no Content-Length on a 209')
    assert.match(head.headers['transfer-encoding'] ?? '', /^chunked$/i, 'Transfer-Encoding: chunked')
    assert.equal(head.headers['cache-control']?.toLowerCase().replace(/\s+/g, ' '), 'no-cache, no-transform, no-store')
    assert.equal(head.headers['x-accel-buffering']?.toLowerCase(), 'no')
    assert.equal(head.headers['content-encoding'], undefined, 'a subscription is never compressed')

    await raw.waitForUpdates(1)
    const first = raw.updates[0]
    const text = Buffer.concat(raw.chunks.map((c) => c.bytes)).toString('utf8').replace(/^[\r\n]+/, '')
    if (first.statusLine) {
      assert.match(first.statusLine, /^HTTP\/?\S* 200\b/, `update status line ${first.statusLine}`)
      assert.match(text, /^HTTP[^\r\n]*\r?\nVersion:/i, 'Version is the first header after the status line')
    } else {
      assert.match(text, /^Version:/i, 'the update starts with Version')
    }
    assert.equal(first.order[0], 'version', `first header is Version, got ${first.order.join(', ')}`)
    assert.deepEqual(first.version, [origin.version(PATH)])
    assert.ok(/^[\x20-\x7e]*$/.test(first.headers.version), 'Version header is ASCII')
    assert.equal(first.patches, undefined, 'the initial update is a snapshot')
    assert.equal(first.headers['content-length'], String(Buffer.byteLength(BODY)), 'Content-Length of the snapshot is its byte length')
    assert.equal(first.body.toString('utf8'), BODY)
  })
})

test('Parents: not-quoted -> 400 naming Parents', async () => {
  const { proxy } = ctx
  const r = await request(proxy.url + PATH, { headers: { Subscribe: 'true', Parents: 'not-quoted' } })
  assert.equal(r.status, 400)
  const body = r.body.toString('utf8').trim()
  assert.ok(body.length > 0 && !body.includes('\n'), `one-line body, got ${JSON.stringify(body)}`)
  assert.match(body, /parents/i)
})

test('Heartbeats: abc -> 400 naming Heartbeats', async () => {
  const { proxy } = ctx
  const r = await request(proxy.url + PATH, { headers: { Subscribe: 'true', Heartbeats: 'abc' } })
  assert.equal(r.status, 400)
  const body = r.body.toString('utf8').trim()
  assert.ok(body.length > 0 && !body.includes('\n'), `one-line body, got ${JSON.stringify(body)}`)
  assert.match(body, /heartbeats/i)
})

test('plain GET returns the body with Version and ETag', async () => {
  const { origin, proxy } = ctx
  const r = await request(proxy.url + PATH)
  assert.equal(r.status, 200)
  assert.equal(r.body.toString('utf8'), origin.text(PATH))
  const v = origin.version(PATH)
  assert.equal(r.headers.version, JSON.stringify(v), 'Version: "<etag without quotes>"')
  assert.equal(r.headers.etag, origin.get(PATH).etag, "ETag is the origin's strong ETag")
})
