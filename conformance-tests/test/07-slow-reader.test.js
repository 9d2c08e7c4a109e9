// 7. A subscriber that stops reading its socket while the origin changes 201
// times (each change inserts or removes ~192 KB in a 64 KB text): the proxy
// buffers at most about one frame per subscriber, keeps its history under
// --history-bytes, and when the reader resumes it catches up with a collapsed
// update or a snapshot and converges to the latest body. No timing asserts.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { useProxy, withSubs } from '../lib/harness.js'
import { rawSubscribe } from '../lib/raw.js'

const PATH = '/big.txt'
const HISTORY_LIMIT = 1024 * 1024 // --history-bytes 1MiB
const CHANGES = 201

function lines(prefix, count) {
  let s = ''
  for (let i = 0; i < count; i++) s += `${prefix} ${String(i).padStart(5, '0')} the quick brown fox — über alles ✓\n`
  return s
}
const LINE = lines('x', 1).length // bytes per line, roughly (utf8)
const A_HEAD = lines('base-head', Math.ceil(32768 / LINE))
const A_TAIL = lines('base-tail', Math.ceil(32768 / LINE))
const B_COMMON = lines('insert', Math.ceil(196608 / LINE))
const A = A_HEAD + A_TAIL // ~64 KB
// Odd changes insert a block in the middle, even ones remove it. The blocks
// differ only in their first line, so every diff (and every catch-up) is one
// contiguous region: cheap for any diff algorithm.
const bodyAt = (i) => (i % 2 === 1 ? A_HEAD + `insert block #${i}\n` + B_COMMON + A_TAIL : A_HEAD + `${i}\n` + A_TAIL)
const MAX_BODY = Buffer.byteLength(bodyAt(1)) + 16

const ctx = useProxy({
  args: ['--history-bytes', '1MiB'],
  seed: (o) => o.set(PATH, A, { contentType: 'text/plain; charset=utf-8' }),
})

test('slow reader: bounded memory, then catch-up to the latest body', { timeout: 180000 }, async () => {
  const { origin, proxy } = ctx
  await withSubs(async (subs) => {
    const slow = rawSubscribe({ port: proxy.port, path: PATH })
    subs.push(slow)
    await slow.waitForVersion(origin.version(PATH))
    slow.sock.pause() // stop reading: kernel buffers fill, then the proxy must hold back

    const pacer = rawSubscribe({ port: proxy.port, path: PATH })
    subs.push(pacer)
    await pacer.waitForVersion(origin.version(PATH))
    assert.equal(await proxy.metric('braid_proxy_subscriptions'), 2, 'two active subscriptions')

    const base = await proxy.metrics()
    const collapsed0 = base.braid_proxy_collapsed_total
    const snapshots0 = base.braid_proxy_snapshots_sent_total
    assert.ok(collapsed0 !== undefined, 'metric braid_proxy_collapsed_total exposed')
    assert.ok(snapshots0 !== undefined, 'metric braid_proxy_snapshots_sent_total exposed')

    let maxPending = 0
    let maxHistory = 0
    const sample = async (when) => {
      const m = await proxy.metrics()
      const pending = m.braid_proxy_subscriber_pending_bytes
      const history = m.braid_proxy_history_bytes
      assert.ok(pending !== undefined && history !== undefined, 'pending/history metrics exposed')
      maxPending = Math.max(maxPending, pending)
      maxHistory = Math.max(maxHistory, history)
      assert.ok(pending <= 3 * MAX_BODY, `${when}: braid_proxy_subscriber_pending_bytes = ${pending} exceeds 3 bodies (${3 * MAX_BODY})`)
      assert.ok(history <= HISTORY_LIMIT, `${when}: braid_proxy_history_bytes = ${history} exceeds --history-bytes ${HISTORY_LIMIT}`)
    }

    let sent = 0
    for (let i = 1; i <= CHANGES; i++) {
      origin.set(PATH, bodyAt(i))
      await proxy.refresh(PATH)
      // The pacer (a fast reader) proves that each version was published.
      await pacer.waitForVersion(origin.version(PATH), 20000)
      if (i % 2 === 1) sent += Buffer.byteLength(B_COMMON)
      if (i % 10 === 0) await sample(`after change ${i}`)
    }
    for (let k = 0; k < 5; k++) await sample('after the changes, reader still paused')
    assert.equal(pacer.text, origin.text(PATH), 'the fast reader is at the latest body')
    assert.ok(sent > 8 * 1024 * 1024, `the changes produced ${sent} bytes of patches, more than socket buffers hold`)

    slow.sock.resume()
    const last = origin.version(PATH)
    await slow.waitForVersion(last, 60000)
    assert.equal(slow.text, origin.text(PATH), 'the slow reader converged to the latest body')
    assert.ok(slow.updates.length < CHANGES + 1, `the slow reader skipped updates (${slow.updates.length} received for ${CHANGES} changes)`)

    const after = await proxy.metrics()
    const merged = after.braid_proxy_collapsed_total - collapsed0 + (after.braid_proxy_snapshots_sent_total - snapshots0)
    assert.ok(merged >= 1, `catch-up was a collapsed update or a snapshot (collapsed +${after.braid_proxy_collapsed_total - collapsed0}, snapshots +${after.braid_proxy_snapshots_sent_total - snapshots0})`)
    assert.ok(after.braid_proxy_history_bytes <= HISTORY_LIMIT, 'history still under the limit')
    slow.check()
    pacer.check()
    console.log(`# slow reader: max pending ${maxPending} B, max history ${maxHistory} B, slow got ${slow.updates.length} updates, pacer ${pacer.updates.length}`)
  })
})
