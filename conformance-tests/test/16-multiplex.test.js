// 16. braid-http's multiplexing (Multiplex-Version 1.0) served by the proxy,
// driven by the real braid-http 1.3.80 client in Node (`multiplex: true`):
// twenty subscriptions over one multiplexer, answered 293 each; they share
// the proxy's state (one watcher per resource); an origin change reaches
// every one of them; aborting one leaves the others live.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { useProxy, withSubs } from '../lib/harness.js'
import { subscribe } from '../lib/client.js'
import { waitFor } from '../lib/util.js'

const PATHS = ['/mux/a.txt', '/mux/b.txt']
const doc = (path, word) => `${path}: a document long enough that one changed word is a patch ✓\n`.repeat(4) + `${word}\n`
const ctx = useProxy({
  seed: (o) => {
    for (const p of PATHS) o.set(p, doc(p, 'first'), { contentType: 'text/plain; charset=utf-8' })
  },
})

test('twenty multiplexed subscriptions: one watcher per resource, every change everywhere', async () => {
  const { origin, proxy } = ctx
  await withSubs(async (subs) => {
    for (let i = 0; i < 20; i++) {
      const path = PATHS[i % PATHS.length]
      // Multiplex from the first; close the idle multiplexer soon after the test.
      const r = await subscribe(proxy.url + path, { multiplex: { after: 0, not_used_timeout: 200 } })
      subs.push(r)
      assert.ok(r.res.multiplexed_through, `subscription ${i} went through a multiplexer`)
      assert.match(r.res.multiplexed_through, /^\/\.well-known\/multiplexer\/[A-Za-z0-9_-]+\/[A-Za-z0-9_-]+$/)
    }
    const muxes = new Set(subs.map((s) => s.res.multiplexed_through.split('/')[3]))
    assert.equal(muxes.size, 1, 'one multiplexer for one origin')
    for (const [i, s] of subs.entries()) await s.waitForVersion(origin.version(PATHS[i % PATHS.length]))

    const before = Object.fromEntries(PATHS.map((p) => [p, origin.count({ method: 'GET', path: p })]))
    for (const p of PATHS) origin.set(p, doc(p, 'second'))
    for (const [i, s] of subs.entries()) {
      const path = PATHS[i % PATHS.length]
      await s.waitForVersion(origin.version(path))
      assert.equal(s.text, origin.text(path))
      assert.ok(s.updates.at(-1).patches, `subscription ${i} got the change as a patch`)
    }
    // Polling at 100 ms for a moment: a few GETs per resource, not twenty.
    for (const p of PATHS) {
      const spent = origin.count({ method: 'GET', path: p }) - before[p]
      assert.ok(spent < 40, `one watcher for ${p}: ${spent} GETs`)
    }

    // Aborting one multiplexed subscription leaves the others live.
    subs[0].close()
    origin.set(PATHS[1], doc(PATHS[1], 'third'))
    for (const [i, s] of subs.entries()) {
      if (i % PATHS.length === 1) await s.waitForVersion(origin.version(PATHS[1]))
    }
    await waitFor(async () => (await proxy.metric('braid_proxy_subscriptions')) === 19, 5000, {
      message: 'the aborted subscription was ended by its DELETE',
    })
  })
  // The client cancels multiplexed requests with DELETE: let those land
  // before the proxy stops (the client would retry them).
  await waitFor(async () => (await proxy.metric('braid_proxy_subscriptions')) === 0, 5000, {
    message: 'every multiplexed subscription ended by its DELETE',
  })
})
