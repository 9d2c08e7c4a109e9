// 8. The origin deletes the resource: the subscriber gets an update with
// status 404 and an empty body; when it is re-created the subscriber gets the
// new body on the same stream.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { useProxy, withSubs } from '../lib/harness.js'
import { subscribe } from '../lib/client.js'
import { waitFor } from '../lib/util.js'

const PATH = '/ephemeral.txt'
const ctx = useProxy({ seed: (o) => o.set(PATH, 'here today 🌞\n', { contentType: 'text/plain' }) })

test('delete at the origin -> 404 update; re-create -> new body', async () => {
  const { origin, proxy } = ctx
  await withSubs(async (subs) => {
    const r = await subscribe(proxy.url + PATH)
    subs.push(r)
    await r.waitForVersion(origin.version(PATH))

    origin.delete(PATH)
    const gone = await waitFor(() => {
      r.check()
      return r.updates.find((u) => u.status === '404')
    }, 10000, { message: () => `no update with status 404; got ${JSON.stringify(r.updates.map((u) => [u.status, u.version]))}` })
    assert.ok(!gone.patches, 'the 404 update carries no patches')
    assert.equal(gone.body_text ?? '', '', 'the 404 update has an empty body')
    const n404 = r.updates.length

    origin.set(PATH, 'back again 🌜\n', { contentType: 'text/plain' })
    await r.waitForVersion(origin.version(PATH))
    assert.equal(r.text, origin.text(PATH), 'the re-created body arrives on the same stream')
    const back = r.updates.at(-1)
    assert.ok(!back.status || back.status === '200', `the re-created update is not an error (status ${back.status})`)
    assert.equal(r.updates.length, n404 + 1, 'one update for the re-creation')

    // A plain GET agrees.
    const res = await fetch(proxy.url + PATH)
    assert.equal(res.status, 200)
    assert.equal(await res.text(), origin.text(PATH))
  })
})
