// 6. Heartbeats: `Heartbeats: 1s` is echoed, blank lines arrive on the wire
// while nothing changes, and the braid-http client (which drops a connection
// after 1.2 × N + 3 s without a byte) stays connected.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { useProxy, withSubs } from '../lib/harness.js'
import { subscribe } from '../lib/client.js'
import { rawSubscribe } from '../lib/raw.js'
import { sleep } from '../lib/util.js'

const PATH = '/quiet.txt'
const ctx = useProxy({ seed: (o) => o.set(PATH, 'nothing happens here\n', { contentType: 'text/plain' }) })

test('Heartbeats: 1s is echoed and blank lines keep the stream alive', async () => {
  const { origin, proxy } = ctx
  await withSubs(async (subs) => {
    const client = await subscribe(proxy.url + PATH, { heartbeats: 1 })
    subs.push(client)
    assert.equal(client.res.headers.get('heartbeats'), '1s', 'Heartbeats header echoed to the braid-http client')

    const raw = rawSubscribe({ port: proxy.port, path: PATH, headers: { Subscribe: 'true', Heartbeats: '1s' } })
    subs.push(raw)
    const head = await raw.waitForHead()
    assert.equal(head.status, 209)
    assert.equal(head.headers.heartbeats, '1s', 'Heartbeats header echoed on the raw response')

    await raw.waitForVersion(origin.version(PATH))
    await client.waitForVersion(origin.version(PATH))
    const quietFrom = Date.now() + 300 // ignore the blank lines that close the first update
    const updatesBefore = raw.updates.length

    // 1.2 × 1 + 3 = 4.2 s is the client's heartbeat timeout: wait past it.
    await sleep(5000)

    client.check() // the client would have recorded "heartbeat not seen in 4.20s"
    raw.check()
    assert.equal(raw.updates.length, updatesBefore, 'no update while nothing changed')
    const later = raw.chunks.filter((c) => c.at >= quietFrom)
    const bytes = Buffer.concat(later.map((c) => c.bytes)).toString('latin1')
    assert.match(bytes, /^[\r\n]*$/, `only blank lines while idle, got ${JSON.stringify(bytes.slice(0, 200))}`)
    const blankLines = (bytes.match(/\n/g) ?? []).length
    assert.ok(blankLines >= 3, `expected at least 3 heartbeat blank lines in ~5 s, got ${blankLines}`)

    // And the stream still delivers updates after the idle period.
    origin.set(PATH, 'something happened\n')
    await client.waitForVersion(origin.version(PATH))
    await raw.waitForVersion(origin.version(PATH))
    assert.equal(client.text, origin.text(PATH))
    assert.equal(raw.text, origin.text(PATH))
  })
})
