// 13. A Braid-native upstream (lib/braid-origin.js, braid-http 1.3.80's own
// server side). The proxy subscribes to it (GET + Subscribe: true, answered
// 209) instead of polling, holds ONE upstream subscription per resource for
// all its clients, re-serves the origin's version ids and parents, resumes
// with Parents = the last version it got when the upstream stream breaks,
// and when the upstream cannot resume (309/410/432, or a snapshot instead of
// patches) diffs the snapshot locally so that clients see no gap.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { startBraidOrigin } from '../lib/braid-origin.js'
import { startProxy } from '../lib/proxy.js'
import { subscribe, isSnapshot } from '../lib/client.js'
import { withSubs } from '../lib/harness.js'
import { codePoints } from '../lib/patch.js'
import { sleep, waitFor } from '../lib/util.js'

const TEST_TIMEOUT = { timeout: 60000 }

// Runs fn({origin, proxy, subs}) with a fresh Braid origin and a proxy in
// front of it; stops both and closes the subscriptions in `subs` afterwards.
async function withBraidProxy(originOpts, fn) {
  const origin = await startBraidOrigin(originOpts)
  let proxy
  let failed = false
  try {
    proxy = await startProxy({ upstream: origin.url, pollInterval: '100ms' })
    return await withSubs((subs) => fn({ origin, proxy, subs }))
  } catch (e) {
    failed = true
    if (proxy?.exited) e.message += `\n--- braid-proxy exited (${JSON.stringify(proxy.exited)}); output ---\n${proxy.output()}`
    throw e
  } finally {
    const crashed = proxy?.exited
    const stopped = await proxy?.stop()
    await origin.close()
    if (!failed && crashed)
      throw new Error(`braid-proxy exited during the test (${JSON.stringify(crashed)})\n--- output ---\n${proxy.output()}`)
    if (!failed && stopped?.forced) throw new Error('braid-proxy did not exit within 5 s of SIGTERM (it was killed)')
  }
}

// Text patches against `text` (the document before the update), in code points.
function cpIndex(text, needle) {
  const i = text.indexOf(needle)
  assert.ok(i >= 0, `test bug: ${JSON.stringify(needle)} not in ${JSON.stringify(text)}`)
  return codePoints(text.slice(0, i))
}
const insertAt = (text, needle, content) => {
  const at = cpIndex(text, needle)
  return { unit: 'text', range: `[${at}:${at}]`, content }
}
const replace = (text, needle, content) => {
  const at = cpIndex(text, needle)
  return { unit: 'text', range: `[${at}:${at + codePoints(needle)}]`, content }
}

const append = (text, content) => ({ unit: 'text', range: `[${codePoints(text)}:${codePoints(text)}]`, content })

// Stores `version` on the origin from patches computed on its current text.
const edit = (origin, path, version, makePatches) =>
  origin.set(path, null, { version, patches: makePatches(origin.text(path)) })

const waitAll = (clients, version, ms = 10000) => Promise.all(clients.map((c) => c.waitForVersion(version, ms)))
const versionsOf = (c) => c.updates.map((u) => u.version?.[0])

// Every update's version comes later in `order` than the one before (no
// duplicate, nothing out of order), and every update after the first names
// the previous one as its parent (no gap).
function assertChain(c, order, label) {
  const seen = versionsOf(c)
  for (const [i, v] of seen.entries()) {
    assert.ok(order.includes(v), `${label}: update ${i} has version ${JSON.stringify(v)}, not one of the origin's ${JSON.stringify(order)}`)
    if (i === 0) continue
    assert.ok(order.indexOf(v) > order.indexOf(seen[i - 1]), `${label}: versions out of order or repeated: ${JSON.stringify(seen)}`)
    assert.deepEqual(c.updates[i].parents, [seen[i - 1]], `${label}: update ${i} (${v}) must have Parents = the previous version ${seen[i - 1]}`)
  }
}

const LONG_TAIL = Array.from({ length: 12 }, (_, i) => `Line ${i}: the quick brown 🦊 jumps over the lazy 🐶.\n`).join('')

test('(a) three clients share one upstream subscription and see the origin\'s versions and patches', TEST_TIMEOUT, async () => {
  await withBraidProxy({}, async ({ origin, proxy, subs }) => {
    const PATH = '/shared.txt'
    origin.set(PATH, 'Shared 📄 doc: alpha beta gamma\n', { version: 'v1' })

    // All three at once, so that a proxy that races would open several upstream streams.
    const clients = await Promise.all([0, 1, 2].map(() => subscribe(proxy.url + PATH)))
    subs.push(...clients)
    await waitAll(clients, 'v1')

    const order = ['v1']
    const steps = [
      ['v2', (t) => [insertAt(t, 'doc', '(draft ✍️) ')]], // after an astral character
      ['v3', (t) => [replace(t, 'alpha', 'ALPHA'), replace(t, 'gamma', 'Γ 🎉')]], // two patches in one update
      ['v4', (t) => [replace(t, ' beta', '')]], // a deletion
      ['v5', (t) => [insertAt(t, '\n', ' — done ✅')]],
    ]
    for (const [v, patches] of steps) {
      edit(origin, PATH, v, patches)
      order.push(v)
      await waitAll(clients, v)
      for (const [k, c] of clients.entries()) assert.equal(c.text, origin.text(PATH), `client ${k} at ${v} equals the origin`)
    }
    assert.equal(origin.text(PATH), 'Shared 📄 (draft ✍️) doc: ALPHA Γ 🎉 — done ✅\n', 'test bug: the patches do not give the expected text')

    const reqs = origin.subscribeRequests(PATH)
    assert.equal(reqs.length, 1, `the origin got exactly one Subscribe request for ${PATH}, got ${reqs.length}`)
    assert.equal(reqs[0].subscribe, 'true', 'the proxy subscribes with `Subscribe: true`')
    assert.ok(reqs[0].heartbeats, 'the upstream subscription asks for heartbeats')
    assert.match(reqs[0].heartbeats, /^\d+(\.\d+)?(ms|s)?$/, `Heartbeats header ${JSON.stringify(reqs[0].heartbeats)}`)
    assert.equal(reqs[0].parents, undefined, 'the first upstream subscription has no Parents')
    assert.equal(reqs[0].status, 209)
    assert.equal(origin.liveSubscriptions(PATH), 1, 'one live upstream subscription')

    // A subscribed Braid upstream is not polled: at a 100 ms poll interval,
    // polling during the changes and this pause would show many plain GETs.
    await sleep(600)
    const polls = origin.plainGets(PATH).length
    assert.ok(polls <= 1, `the proxy polled the Braid upstream (${polls} plain GETs of ${PATH})`)

    for (const [k, c] of clients.entries()) {
      c.check()
      assert.deepEqual(versionsOf(c), order, `client ${k} saw every origin version, in order, with the origin's ids`)
      assert.ok(isSnapshot(c.updates[0]), `client ${k}: the first update is a snapshot`)
      assert.equal(c.updates[0].body_text, 'Shared 📄 doc: alpha beta gamma\n', `client ${k}: snapshot of v1`)
      assertChain(c, order, `client ${k}`)
      for (const [i, u] of c.updates.entries()) {
        if (i === 0) continue
        assert.ok(u.patches?.length > 0, `client ${k}: ${u.version} arrives as patches, not a snapshot`)
        for (const p of u.patches) assert.equal(p.unit, 'text', `client ${k}: ${u.version} uses text ranges`)
      }
    }
  })
})

test('(b) a broken or ended upstream stream is resumed with Parents = the last version, without gaps', TEST_TIMEOUT, async () => {
  await withBraidProxy({}, async ({ origin, proxy, subs }) => {
    const PATH = '/reconnect.txt'
    origin.set(PATH, 'Reconnect 🔌 log:\n', { version: 'v1' })
    const clients = await Promise.all([0, 1].map(() => subscribe(proxy.url + PATH)))
    subs.push(...clients)
    await waitAll(clients, 'v1')
    const order = ['v1']
    const line = (v) => (t) => [append(t, `entry ${v} ✓\n`)]
    const change = async (v, { wait = true } = {}) => {
      edit(origin, PATH, v, line(v))
      order.push(v)
      if (wait) await waitAll(clients, v)
    }
    await change('v2')
    await change('v3')
    assert.equal(origin.subscribeRequests(PATH).length, 1)

    // Break it, and change the resource before the proxy can be back.
    for (const [how, last, missed, after] of [
      ['destroy', 'v3', 'v4', 'v5'],
      ['end', 'v5', 'v6', 'v7'],
    ]) {
      const before = origin.subscribeRequests(PATH).length
      const droppedAt = Date.now()
      assert.equal(origin.dropSubscriptions(PATH, { how }), 1, 'one upstream subscription to drop')
      await change(missed, { wait: false }) // same tick: the proxy is disconnected now
      await waitFor(() => origin.subscribeRequests(PATH).length > before, 5000, {
        message: `the proxy did not subscribe again within 5 s after the upstream stream was ${how === 'end' ? 'ended' : 'reset'}`,
      })
      const again = origin.subscribeRequests(PATH)[before]
      assert.equal(again.parents, JSON.stringify(last), `after a ${how}, the proxy resubscribes with Parents: "${last}" (the last version it got)`)
      assert.equal(again.subscribe, 'true')
      assert.equal(again.status, 209)
      assert.ok(again.at - droppedAt < 3000, `the reconnection came after ${again.at - droppedAt} ms (backoff starts around 100 ms)`)
      await waitAll(clients, missed)
      await change(after) // live again
    }

    await sleep(300)
    const reqs = origin.subscribeRequests(PATH)
    assert.equal(reqs.length, 3, `one initial subscription and one per drop, got ${reqs.length}: ${JSON.stringify(reqs.map((r) => r.parents ?? null))}`)
    assert.equal(origin.liveSubscriptions(PATH), 1, 'one live upstream subscription afterwards')
    for (const [k, c] of clients.entries()) {
      c.check() // the client's own stream never broke
      assert.equal(c.text, origin.text(PATH), `client ${k} converged to the origin body`)
      assert.equal(c.versionId, 'v7')
      assertChain(c, order, `client ${k}`)
      for (const v of ['v4', 'v6'])
        assert.ok(versionsOf(c).includes(v), `client ${k} got ${v}, the change made while the proxy was disconnected: ${JSON.stringify(versionsOf(c))}`)
      for (const u of c.updates.slice(1)) assert.ok(!isSnapshot(u), `client ${k}: ${u.version} is patches (the resume was patches)`)
    }
  })
})

for (const status of [309, 410, 432]) {
  test(`(c) a resume answered ${status} is followed by a fetch without Parents; clients get a diff to the new version`, TEST_TIMEOUT, async () => {
    await withBraidProxy({ unknownParents: status }, async ({ origin, proxy, subs }) => {
      const PATH = '/forgotten.txt'
      origin.set(PATH, 'Title: forgotten history 🕳️\n' + LONG_TAIL, { version: 'v1' })
      const clients = await Promise.all([0, 1].map(() => subscribe(proxy.url + PATH)))
      subs.push(...clients)
      await waitAll(clients, 'v1')
      edit(origin, PATH, 'v2', (t) => [replace(t, 'Line 3', 'LINE 3')])
      await waitAll(clients, 'v2')
      edit(origin, PATH, 'v3', (t) => [replace(t, 'lazy 🐶.\nLine 5', 'sleepy 🐕.\nLine 5')])
      await waitAll(clients, 'v3')

      // Drop, change twice while the proxy is away, forget v3 and v4.
      origin.dropSubscriptions(PATH)
      edit(origin, PATH, 'v4', (t) => [replace(t, 'forgotten', 'lost')])
      edit(origin, PATH, 'v5', (t) => [insertAt(t, 'Line 11', '(appended 🆕) ')])
      origin.forgetHistory(PATH)

      await waitAll(clients, 'v5')
      for (const [k, c] of clients.entries()) {
        c.check()
        assert.equal(c.text, origin.text(PATH), `client ${k} converged to the origin's final body`)
        assert.deepEqual(versionsOf(c), ['v1', 'v2', 'v3', 'v5'], `client ${k}: v4 never reached the proxy; no duplicates`)
        const last = c.updates.at(-1)
        assert.deepEqual(last.parents, ['v3'], `client ${k}: the catch-up update has Parents = the version the client had`)
        assert.ok(!isSnapshot(last), `client ${k}: a small change to a ${origin.text(PATH).length}-char body is sent as a local diff, not a snapshot`)
      }

      const reqs = origin.subscribeRequests(PATH)
      assert.equal(reqs[1]?.parents, '"v3"', 'the proxy first tried to resume from v3')
      assert.equal(reqs[1].status, status, `and the origin answered ${status}`)
      const later = origin.requests.filter((r) => r.method === 'GET' && r.path === PATH && r.at >= reqs[1].at && r !== reqs[1])
      assert.ok(later.length >= 1, 'the proxy fetched again after the refusal')
      assert.equal(later[0].parents, undefined, `after ${status}, the proxy refetches without Parents`)
      const refused = reqs.filter((r) => r.status === status).length
      assert.equal(refused, 1, `the proxy did not retry the unknown Parents (${refused} requests answered ${status})`)

      // The new upstream subscription is live.
      edit(origin, PATH, 'v6', (t) => [replace(t, 'Title', 'TITLE')])
      await waitAll(clients, 'v6')
      await sleep(300)
      assert.equal(origin.liveSubscriptions(PATH), 1, 'one live upstream subscription afterwards')
      assert.equal(origin.requests.filter((r) => r.status === status).length, 1, `still one ${status}`)
      for (const [k, c] of clients.entries()) {
        assert.equal(c.text, origin.text(PATH), `client ${k} live after the refetch`)
        assertChain(c, ['v1', 'v2', 'v3', 'v5', 'v6'], `client ${k}`)
      }
    })
  })
}

test('(d) a client resuming from a version the proxy has seen gets only what it missed', TEST_TIMEOUT, async () => {
  await withBraidProxy({}, async ({ origin, proxy, subs }) => {
    const PATH = '/window.txt'
    origin.set(PATH, 'Window 🪟: one\n', { version: 'v1' })
    const rec = await subscribe(proxy.url + PATH)
    subs.push(rec)
    await rec.waitForVersion('v1')
    const words = { v2: 'two', v3: 'three 3️⃣', v4: 'four', v5: 'five ✋' }
    for (const [v, w] of Object.entries(words)) {
      edit(origin, PATH, v, (t) => [insertAt(t, '\n', `, ${w}`)])
      await rec.waitForVersion(v)
    }
    const v3Body = origin.bodyAt(PATH, 'v3')

    const late = await subscribe(proxy.url + PATH, { parents: ['v3'] }, { initial: { body: v3Body, version: ['v3'] } })
    subs.push(late)
    await late.waitForVersion('v5')
    assert.equal(late.text, origin.text(PATH), 'the resumed client converges')
    assert.ok(late.updates.length >= 1 && late.updates.length <= 2, `one or two updates for v4 and v5, got ${late.updates.length}`)
    assert.deepEqual(late.updates[0].parents, ['v3'], 'the first update builds on v3')
    for (const u of late.updates) assert.ok(!isSnapshot(u), `${u.version} is patches, not a snapshot`)
    assert.ok(versionsOf(late).every((v) => v === 'v4' || v === 'v5'), `only the missed versions: ${JSON.stringify(versionsOf(late))}`)
    assertChain(late, ['v3', 'v4', 'v5'], 'resumed client')

    // Resuming at the current version: nothing until the next change.
    const current = await subscribe(proxy.url + PATH, { parents: ['v5'] }, { initial: { body: origin.text(PATH), version: ['v5'] } })
    subs.push(current)
    await sleep(500)
    current.check()
    assert.equal(current.updates.length, 0, `no update while nothing changed, got ${JSON.stringify(versionsOf(current))}`)
    edit(origin, PATH, 'v6', (t) => [insertAt(t, '\n', ', six')])
    await waitAll([rec, late, current], 'v6')
    assert.equal(current.updates.length, 1)
    assert.deepEqual(current.updates[0].parents, ['v5'])
    for (const c of [rec, late, current]) assert.equal(c.text, origin.text(PATH))

    // The proxy served both resumes itself.
    const reqs = origin.subscribeRequests(PATH)
    assert.equal(reqs.length, 1, `still one upstream subscription, got ${reqs.length} Subscribe requests: ${JSON.stringify(reqs.map((r) => r.parents ?? null))}`)
    assert.equal(origin.liveSubscriptions(PATH), 1)
  })
})

test('(e) a snapshot from the upstream (live, or answering a resume) reaches clients as a diff with the right Parents', TEST_TIMEOUT, async () => {
  await withBraidProxy({ unknownParents: 'snapshot' }, async ({ origin, proxy, subs }) => {
    const PATH = '/snapshots.txt'
    const v1 = 'Snapshots 📸\n' + LONG_TAIL
    origin.set(PATH, v1, { version: 'v1' })
    const c = await subscribe(proxy.url + PATH)
    subs.push(c)
    await c.waitForVersion('v1')

    // A live update that is a full body (with Parents) instead of patches.
    origin.set(PATH, v1.replace('Line 7', 'Line seven 7️⃣'), { version: 'v2', snapshot: true })
    await c.waitForVersion('v2')
    assert.equal(c.text, origin.text(PATH))
    assert.deepEqual(c.updates.at(-1).parents, ['v1'])
    assert.ok(!isSnapshot(c.updates.at(-1)), 'a one-line change in a snapshot is re-served as a diff')

    // The resume is answered 209 with a snapshot, because v2 was forgotten.
    origin.dropSubscriptions(PATH)
    edit(origin, PATH, 'v3', (t) => [replace(t, 'Snapshots', 'SNAPSHOTS')])
    edit(origin, PATH, 'v4', (t) => [replace(t, 'Line 2:', 'Line two:')])
    origin.forgetHistory(PATH)
    await c.waitForVersion('v4')
    c.check()
    assert.equal(c.text, origin.text(PATH))
    assert.deepEqual(versionsOf(c), ['v1', 'v2', 'v4'])
    assert.deepEqual(c.updates.at(-1).parents, ['v2'], 'Parents = the version the client had')
    assert.ok(!isSnapshot(c.updates.at(-1)), 'the resume snapshot is re-served as a diff')

    const reqs = origin.subscribeRequests(PATH)
    assert.equal(reqs.length, 2, 'one resubscription, answered with a snapshot: nothing to refetch')
    assert.equal(reqs[1].parents, '"v2"')
    assert.equal(reqs[1].status, 209)
    assert.equal(origin.liveSubscriptions(PATH), 1)
  })
})
