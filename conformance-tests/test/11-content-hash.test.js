// 11. An origin resource without ETag: versions come from the content. They
// are valid Braid version strings (JSON string literals, ASCII), plain GET and
// subscription agree, and each change yields a new version whose Parents is
// the previous one.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { useProxy, withSubs } from '../lib/harness.js'
import { subscribe } from '../lib/client.js'
import { request } from '../lib/proxy.js'
import { waitFor } from '../lib/util.js'

const PATH = '/no-etag.txt'
const ctx = useProxy({ seed: (o) => o.set(PATH, 'no etag here 🏷️\n', { contentType: 'text/plain', etag: false }) })

test('without ETag the proxy derives versions from the content', async () => {
  const { origin, proxy } = ctx
  assert.equal(origin.get(PATH).etag, null)
  await withSubs(async (subs) => {
    const r = await subscribe(proxy.url + PATH)
    subs.push(r)
    await r.waitForUpdates(1)
    const v1 = r.updates[0].version
    assert.ok(Array.isArray(v1) && v1.length === 1 && typeof v1[0] === 'string' && v1[0].length > 0, `version ${JSON.stringify(v1)}`)
    assert.equal(r.text, origin.text(PATH))

    const g = await request(proxy.url + PATH)
    assert.equal(g.status, 200)
    assert.ok(/^[\x20-\x7e]+$/.test(g.headers.version ?? ''), 'Version header is present and ASCII')
    assert.deepEqual(JSON.parse('[' + g.headers.version + ']'), v1, 'plain GET and subscription agree on the version')

    origin.set(PATH, 'no etag here 🏷️ — edited\n')
    await waitFor(() => {
      r.check()
      return r.updates.length >= 2
    }, 10000, { message: 'an update after the change' })
    const u = r.updates[1]
    assert.notDeepEqual(u.version, v1, 'a new content -> a new version')
    assert.deepEqual(u.parents, v1)
    assert.equal(r.text, origin.text(PATH))
  })
})
