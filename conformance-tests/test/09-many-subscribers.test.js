// 9. Fifty braid-http clients on one resource, five changes: every client
// converges after every change, and the origin sees one poller's worth of
// GETs, not one per subscriber per change. Closing the clients brings the
// subscription gauge back to zero.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { useProxy, withSubs } from '../lib/harness.js'
import { subscribe } from '../lib/client.js'
import { waitFor } from '../lib/util.js'

const PATH = '/popular.txt'
const N = 50
const CHANGES = 5
const POLL_MS = 100
const ctx = useProxy({ seed: (o) => o.set(PATH, 'popular 🔥 v0\n', { contentType: 'text/plain' }) })

test(`${N} subscribers, ${CHANGES} changes: all converge, origin load independent of subscribers`, async () => {
  const { origin, proxy } = ctx
  // Let the proxy learn the resource before counting.
  const warm = await fetch(proxy.url + PATH)
  await warm.arrayBuffer()

  await withSubs(async (subs) => {
    const gets0 = origin.count({ method: 'GET', path: PATH })
    const t0 = Date.now()
    const clients = await Promise.all(Array.from({ length: N }, () => subscribe(proxy.url + PATH)))
    subs.push(...clients)
    for (const c of clients) await c.waitForVersion(origin.version(PATH))
    await waitFor(async () => (await proxy.metric('braid_proxy_subscriptions')) === N, 5000, {
      message: `braid_proxy_subscriptions should be ${N}`,
    })

    for (let i = 1; i <= CHANGES; i++) {
      const s = origin.text(PATH)
      origin.set(PATH, s.replace(/v\d+\n$/, `v${i}\n`) + `line ${i} ✓\n`)
      const v = origin.version(PATH)
      for (const c of clients) await c.waitForVersion(v)
      for (const [k, c] of clients.entries()) assert.equal(c.text, origin.text(PATH), `client ${k} after change ${i}`)
    }
    const elapsed = Date.now() - t0
    const gets = origin.count({ method: 'GET', path: PATH }) - gets0
    const pollBudget = Math.ceil(elapsed / POLL_MS) * 2 + 10
    assert.ok(gets < N * CHANGES / 2, `origin saw ${gets} GETs for ${N} subscribers × ${CHANGES} changes`)
    assert.ok(gets <= pollBudget, `origin saw ${gets} GETs in ${elapsed} ms; one poller at ${POLL_MS} ms allows about ${pollBudget}`)
    for (const c of clients) {
      assert.equal(c.updates.length, CHANGES + 1, 'a snapshot and one update per change')
      c.close()
    }
  })

  await waitFor(async () => (await proxy.metric('braid_proxy_subscriptions')) === 0, 10000, {
    message: 'braid_proxy_subscriptions should drop to 0 after the clients disconnect',
  })
})
