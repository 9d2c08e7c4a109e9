// 5. Resuming with parents = the current version: 209 at once, then nothing
// until the resource changes, then exactly that change.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { useProxy, withSubs } from '../lib/harness.js'
import { subscribe } from '../lib/client.js'
import { sleep } from '../lib/util.js'

const PATH = '/current.txt'
const ctx = useProxy({ seed: (o) => o.set(PATH, 'up to date 👍\n', { contentType: 'text/plain' }) })

test('resume at the current version sends nothing until the next change', async () => {
  const { origin, proxy } = ctx
  await withSubs(async (subs) => {
    // Let the proxy learn the resource first (a plain GET through it).
    const warm = await fetch(proxy.url + PATH)
    assert.equal(warm.status, 200)
    await warm.arrayBuffer()

    const cur = origin.version(PATH)
    const body = origin.text(PATH)
    const r = await subscribe(proxy.url + PATH, { parents: [cur] }, { initial: { body, version: [cur] } })
    subs.push(r)
    assert.equal(r.res.status, 209, 'headers arrive before any update exists')

    await sleep(1500) // 15 poll intervals without a change
    r.check()
    assert.equal(r.updates.length, 0, `no update while nothing changed, got ${JSON.stringify(r.updates.map((u) => u.version))}`)

    origin.set(PATH, 'up to date 👍 — changed\n')
    await r.waitForVersion(origin.version(PATH))
    assert.equal(r.updates.length, 1, 'exactly one update for one change')
    assert.deepEqual(r.updates[0].parents, [cur], 'its Parents is the version we resumed at')
    assert.ok(r.updates[0].patches, 'it carries patches')
    assert.equal(r.text, origin.text(PATH))
  })
})
