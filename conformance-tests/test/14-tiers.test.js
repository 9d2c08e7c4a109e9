// 14. Tiers: a plain origin, a shield braid-proxy, and two edge
// braid-proxies following it (one over HTTP/1.1, one over h2c), with a TCP
// load balancer in front of the edges. The real braid-http client
// subscribes through the balancer with `retry`. When its edge dies, it
// reconnects, lands on the other edge with Parents = the version it holds,
// and since version ids are the same at every tier, that edge sends only
// what it missed.

import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import net from 'node:net'
import { startOrigin } from '../lib/origin.js'
import { startProxy } from '../lib/proxy.js'
import { subscribe, isSnapshot } from '../lib/client.js'
import { rawSubscribe } from '../lib/raw.js'

const PATH = '/tiers.txt'
const procs = []
const closers = []
after(async () => {
  for (const c of closers) c()
  for (const p of procs) await p.stop()
})

// A TCP balancer: each connection goes to the first target that accepts it.
async function startBalancer(ports) {
  const sockets = new Set()
  const server = net.createServer((client) => {
    sockets.add(client)
    client.on('close', () => sockets.delete(client))
    client.pause()
    const attempt = (i) => {
      if (i >= ports.length) return client.destroy()
      const upstream = net.connect(ports[i], '127.0.0.1')
      upstream.once('error', () => attempt(i + 1))
      upstream.once('connect', () => {
        sockets.add(upstream)
        upstream.on('close', () => sockets.delete(upstream))
        upstream.on('error', () => client.destroy())
        client.on('error', () => upstream.destroy())
        client.pipe(upstream)
        upstream.pipe(client)
        client.resume()
      })
    }
    attempt(0)
  })
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve))
  return {
    url: `http://127.0.0.1:${server.address().port}`,
    close() {
      for (const s of sockets) s.destroy()
      server.close()
    },
  }
}

const text = (n) => `${'A line that stays the same in every version.\n'.repeat(20)}edit ${n}\n`

test('a client resumes on another edge with the same version ids', { timeout: 90000 }, async () => {
  const origin = await startOrigin()
  closers.push(() => origin.close())
  origin.set(PATH, text(0), { contentType: 'text/plain' })
  // Named ids, so that the Via check below can tell the tiers apart.
  const shield = await startProxy({ upstream: origin.url, args: ['--proxy-id', 'shield'] })
  procs.push(shield)
  const edge1 = await startProxy({ upstream: shield.url, args: ['--proxy-id', 'edge-1'] })
  procs.push(edge1)
  const edge2 = await startProxy({ upstream: shield.url, args: ['--proxy-id', 'edge-2', '--upstream-h2c'] })
  procs.push(edge2)
  const balancer = await startBalancer([edge1.port, edge2.port])
  closers.push(() => balancer.close())

  // A subscriber straight on edge 2 keeps it following the resource. It
  // names the balancer's host, as the client does: the host is part of a
  // resource's key (the origin may answer each host differently).
  const watcher = rawSubscribe({ port: edge2.port, path: PATH, hostHeader: new URL(balancer.url).host })
  await watcher.waitForHead()
  closers.push(() => watcher.close())
  let replica
  const sentParents = []
  replica = await subscribe(balancer.url + PATH, {
    retry: true,
    parents: () => {
      const p = replica?.version ?? undefined
      sentParents.push(p)
      return p
    },
  })
  closers.push(() => replica.close())

  for (let n = 1; n <= 3; n++) {
    origin.set(PATH, text(n))
    await replica.waitForVersion(origin.version(PATH))
    await watcher.waitForVersion(origin.version(PATH))
  }
  // The same ids at every tier: the origin's ETags.
  const ids = (r) => r.updates.map((u) => u.version[0])
  assert.deepEqual(ids(replica).slice(-3), ids(watcher).slice(-3))
  assert.equal(replica.versionId, origin.version(PATH))

  // Edge 1 dies; a change happens while the client is away.
  const held = replica.version[0]
  const before = replica.updates.length
  const stopped = await edge1.stop()
  assert.ok(!stopped.forced, 'edge 1 exits on SIGTERM with a subscription open')
  origin.set(PATH, text(4))
  await watcher.waitForVersion(origin.version(PATH))

  // braid-http retries after 1 s; the balancer sends it to edge 2.
  await replica.waitForVersion(origin.version(PATH), 30000)
  assert.equal(replica.text, origin.text(PATH))
  assert.ok(sentParents.some((p) => Array.isArray(p) && p[0] === held), `the client reconnected with Parents: ${JSON.stringify(held)}`)
  const resumed = replica.updates.slice(before)
  assert.ok(resumed.length >= 1)
  assert.ok(!isSnapshot(resumed[0]), 'edge 2 knew the version the client held: patches, not a snapshot')
  assert.deepEqual(resumed[0].parents, [held])

  // The origin saw only the shield.
  const vias = origin.requests.map((r) => r.headers.via ?? '')
  assert.ok(vias.length > 0)
  for (const via of vias) assert.match(via, /(1\.1|2) shield$/, `an origin request came from elsewhere: Via ${JSON.stringify(via)}`)
})
