// 12. braid-http's own reconnection: a client with `retry: true` and a
// `parents` function survives a proxy restart. It reconnects on its own with
// Parents = the version it holds; the new proxy process has no history for
// it, so it answers with a snapshot of the current body.

import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { startOrigin } from '../lib/origin.js'
import { startProxy } from '../lib/proxy.js'
import { subscribe } from '../lib/client.js'
import { sleep } from '../lib/util.js'

const PATH = '/restart.txt'
const procs = []
let origin
after(async () => {
  for (const p of procs) await p.stop()
  await origin?.close()
})

test('retrying client resumes across a proxy restart', { timeout: 90000 }, async () => {
  origin = await startOrigin()
  origin.set(PATH, 'before restart ⏮\n', { contentType: 'text/plain' })
  const first = await startProxy({ upstream: origin.url })
  procs.push(first)

  let replica
  const sentParents = []
  replica = await subscribe(first.url + PATH, {
    retry: true,
    parents: () => {
      const p = replica?.version ?? undefined
      sentParents.push(p)
      return p
    },
  })
  try {
    await replica.waitForVersion(origin.version(PATH))
    const held = replica.version[0]

    const stopped = await first.stop()
    assert.ok(!stopped.forced, 'the proxy exits on SIGTERM while a subscription is open')
    origin.set(PATH, 'after restart ⏭\n')

    // Same port, so that the client's URL still works. The old socket may
    // linger briefly: try a few times.
    let second
    for (let attempt = 0; attempt < 10 && !second; attempt++) {
      try {
        second = await startProxy({ upstream: origin.url, listen: `127.0.0.1:${first.port}` })
      } catch (e) {
        if (attempt === 9) throw e
        await sleep(300)
      }
    }
    procs.push(second)

    // braid-http waits 1 s, then 2 s, then 3 s between attempts.
    await replica.waitForVersion(origin.version(PATH), 30000)
    assert.equal(replica.text, origin.text(PATH), 'the reconnected client has the current body')
    const last = replica.updates.at(-1)
    assert.ok(last.body && !last.patches, 'the new proxy answered the unknown parents with a snapshot')
    assert.ok(sentParents.some((p) => Array.isArray(p) && p[0] === held), `the client reconnected with Parents: ${JSON.stringify(held)}`)
  } finally {
    replica.close()
  }
})
