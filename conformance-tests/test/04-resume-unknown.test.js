// 4. Resuming from a version the proxy has never seen yields a snapshot of
// the current body (not an error), after which the stream is live.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { useProxy, withSubs } from '../lib/harness.js'
import { subscribe, isSnapshot } from '../lib/client.js'

const PATH = '/unknown.txt'
const ctx = useProxy({ seed: (o) => o.set(PATH, 'current body ✨\n', { contentType: 'text/plain' }) })

test('resume from an unknown version gets a snapshot of the current body', async () => {
  const { origin, proxy } = ctx
  await withSubs(async (subs) => {
    const r = await subscribe(proxy.url + PATH, { parents: ['nope'] })
    subs.push(r)
    await r.waitForUpdates(1)
    const first = r.updates[0]
    assert.ok(isSnapshot(first), 'the first update is a snapshot (body, no patches)')
    assert.equal(first.body_text, origin.text(PATH), 'the snapshot is the current body')
    assert.deepEqual(first.version, [origin.version(PATH)], "the snapshot's Version is the current ETag")

    origin.set(PATH, 'current body ✨ and more\n')
    await r.waitForVersion(origin.version(PATH))
    assert.equal(r.text, origin.text(PATH), 'live after the snapshot')
    assert.equal(r.updates.length, 2)
    assert.deepEqual(r.updates[1].parents, first.version)
  })
})
