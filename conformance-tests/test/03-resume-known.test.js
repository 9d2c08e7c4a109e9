// 3. Resuming with `parents: [v]` for a version inside the proxy's history
// window yields only the updates after v (possibly collapsed), never a
// snapshot, and the replica rebuilt from the body at v converges.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { useProxy, withSubs } from '../lib/harness.js'
import { subscribe, isSnapshot } from '../lib/client.js'
import { spliceText } from '../lib/patch.js'

const PATH = '/resume.txt'
const ctx = useProxy({ seed: (o) => o.set(PATH, 'alpha 🅰 beta 🅱 gamma\n', { contentType: 'text/plain' }) })

test('resume from a version in the window gets exactly the missed updates', async () => {
  const { origin, proxy } = ctx
  await withSubs(async (subs) => {
    // A recorder subscriber tells us when the proxy has seen each version.
    const rec = await subscribe(proxy.url + PATH)
    subs.push(rec)
    const history = [{ version: origin.version(PATH), body: origin.text(PATH) }]
    await rec.waitForVersion(history[0].version)
    for (let i = 0; i < 5; i++) {
      const s = origin.text(PATH)
      origin.set(PATH, spliceText(s, 6 + i, 6 + i, `[${i}✓]`))
      history.push({ version: origin.version(PATH), body: origin.text(PATH) })
      await rec.waitForVersion(origin.version(PATH))
    }
    rec.close()

    const cases = [
      { name: 'from the 3rd version', from: history[2] },
      { name: 'from the initial version', from: history[0] },
    ]
    for (const { name, from } of cases) {
      const missed = history.slice(history.indexOf(from) + 1).map((h) => h.version)
      const r = await subscribe(proxy.url + PATH, { parents: [from.version] }, { initial: { body: from.body, version: [from.version] } })
      subs.push(r)
      await r.waitForVersion(origin.version(PATH))
      assert.equal(r.text, origin.text(PATH), `${name}: replica converges to the origin body`)
      assert.ok(r.updates.length >= 1 && r.updates.length <= missed.length, `${name}: between 1 and ${missed.length} updates, got ${r.updates.length}`)
      assert.deepEqual(r.updates[0].parents, [from.version], `${name}: the first update's Parents is the resumed version`)
      let prev = from.version
      for (const [i, u] of r.updates.entries()) {
        assert.ok(!isSnapshot(u), `${name}: update ${i} is patches, not a snapshot`)
        assert.deepEqual(u.parents, [prev], `${name}: update ${i} Parents chain`)
        assert.ok(missed.includes(u.version?.[0]), `${name}: update ${i} version ${JSON.stringify(u.version)} is one of the missed versions`)
        prev = u.version[0]
      }
      r.close()
    }

    // A resumed subscription is live afterwards.
    const from = history.at(-1)
    const live = await subscribe(proxy.url + PATH, { parents: [from.version] }, { initial: { body: from.body, version: [from.version] } })
    subs.push(live)
    origin.set(PATH, origin.text(PATH) + 'delta 🔺\n')
    await live.waitForVersion(origin.version(PATH))
    assert.equal(live.updates.length, 1, 'exactly one update after resuming at the current version')
    assert.deepEqual(live.updates[0].parents, [from.version])
    assert.equal(live.text, origin.text(PATH))
  })
})
