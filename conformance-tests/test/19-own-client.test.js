// 19. The project's own browser client (examples/browser/braid-proxy-client.js,
// built into the binary for the demo page), run in Node with Node's fetch:
// its parser gives the same updates however the stream is cut into
// chunks; its patches land in code points (text) and UTF-8 bytes (bytes);
// live, it follows origin changes through the proxy, and when the proxy
// is killed and restarted on its port it resumes with Parents and
// catches up with patches, not a snapshot.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import fs from 'node:fs'
import path from 'node:path'
import vm from 'node:vm'
import { fileURLToPath } from 'node:url'
import { startOrigin } from '../lib/origin.js'
import { startProxy } from '../lib/proxy.js'
import { waitFor, sleep } from '../lib/util.js'

const here = path.dirname(fileURLToPath(import.meta.url))
const CLIENT = path.join(here, '..', '..', 'examples', 'browser', 'braid-proxy-client.js')

/** Loads the client as the page does, into its own `window`. */
function loadClient() {
  const window = {}
  vm.runInNewContext(fs.readFileSync(CLIENT, 'utf8'), {
    window, TextEncoder, TextDecoder, fetch, AbortController, setTimeout, clearTimeout, JSON, Promise,
  }, { filename: CLIENT })
  return window.braidProxyClient
}

const STREAM = [
  '\r\n',
  'Version: "v1"\r\nContent-Type: text/plain\r\nContent-Length: 12\r\n\r\nhé 😀 you\r\n\r\n',
  '\r\n',
  'Version: "v2"\r\nParents: "v1"\r\nContent-Length: 4\r\nContent-Range: text [5:8]\r\n\r\nthem\r\n\r\n',
  'Version: "v3"\r\nParents: "v2"\r\nPatches: 2\r\n\r\n' +
    'Content-Length: 3\r\nContent-Range: text [0:2]\r\n\r\nHé\r\n\r\n' +
    'Content-Length: 1\r\nContent-Range: text [9:9]\r\n\r\n!\r\n\r\n',
  'HTTP/1.1 404 Not Found\r\nVersion: "v4"\r\nParents: "v3"\r\nContent-Length: 0\r\n\r\n\r\n\r\n',
].join('')

/** Every update of `bytes` fed in the given chunks, as the client's subscribe loop does. */
function parseAll(client, chunks) {
  let buf = new Uint8Array(0)
  const out = []
  for (const chunk of chunks) {
    const joined = new Uint8Array(buf.length + chunk.length)
    joined.set(buf)
    joined.set(chunk, buf.length)
    buf = joined
    for (let parsed; (parsed = client.parseUpdate(buf, 0)); ) {
      out.push(parsed.update)
      buf = buf.slice(parsed.next)
    }
  }
  return out
}

const plain = (updates) => JSON.parse(JSON.stringify(updates, (k, v) => (v instanceof Uint8Array ? Array.from(v) : v)))

test('the own client parses any chunking, and applies patches in code points and bytes', () => {
  const client = loadClient()
  const bytes = new TextEncoder().encode(STREAM)
  const whole = parseAll(client, [bytes])
  assert.deepEqual(plain(whole.map((u) => [u.status, u.version, u.parents])), [
    [200, ['v1'], []], [200, ['v2'], ['v1']], [200, ['v3'], ['v2']], [404, ['v4'], ['v3']],
  ])
  let text = whole[0].body_text
  assert.equal(text, 'hé 😀 you')
  text = client.applyPatches(text, whole[1].patches)
  assert.equal(text, 'hé 😀 them', 'code points: the emoji is one unit')
  text = client.applyPatches(text, whole[2].patches)
  assert.equal(text, 'Hé 😀 them!', 'both ranges against the document before the update')
  // Every cut into two and three chunks gives the same updates.
  for (let i = 1; i < bytes.length; i++) {
    assert.deepEqual(plain(parseAll(client, [bytes.subarray(0, i), bytes.subarray(i)])), plain(whole), `cut at ${i}`)
    const j = Math.min(bytes.length - 1, i + 7)
    if (j > i) assert.deepEqual(plain(parseAll(client, [bytes.subarray(0, i), bytes.subarray(i, j), bytes.subarray(j)])), plain(whole))
  }
  // bytes ranges count UTF-8 bytes: "é" is two.
  assert.equal(client.applyPatches('é!', [{ unit: 'bytes', range: '[2:3]', content_text: '?' }]), 'é?')
  assert.throws(() => client.applyPatches('ab', [{ unit: 'text', range: '[1:5]', content_text: '' }]), /outside/)
  assert.throws(() => client.parseUpdate(new TextEncoder().encode('no colon here\r\n\r\n'), 0), /not a header line/)
})

test('the own client follows changes and resumes with Parents across a proxy restart', { timeout: 60000 }, async () => {
  const client = loadClient()
  const origin = await startOrigin()
  origin.set('/doc', 'one two three\n')
  let proxy = await startProxy({ upstream: origin.url })
  const seen = []
  const states = []
  let text = null
  const sub = client.subscribe(`${proxy.url}/doc`, {
    heartbeats: 2,
    onState: (state) => states.push(state),
    onUpdate: (u) => {
      seen.push(u.patches ? 'patch' : 'snapshot')
      text = u.patches ? client.applyPatches(text, u.patches) : u.body_text
    },
  })
  try {
    await waitFor(() => text === origin.text('/doc'), 10000, { message: () => `first state: ${JSON.stringify(text)}` })
    origin.set('/doc', 'one 2 three 😀\n')
    await waitFor(() => text === origin.text('/doc'), 10000, { message: () => `change: ${JSON.stringify(text)}` })
    assert.deepEqual(seen, ['snapshot', 'patch'])

    // The proxy dies; the one started on its port knows the current
    // version (the origin's ETag), so the resume sends nothing, and the
    // next change arrives as a patch.
    const port = proxy.port
    proxy.child.kill('SIGKILL')
    await proxy.stop()
    await waitFor(() => states.includes('reconnecting'), 10000, { message: () => `states ${states.join(',')}` })
    proxy = await startProxy({ upstream: origin.url, listen: `127.0.0.1:${port}` })
    await waitFor(() => states.filter((s) => s === 'live').length >= 2, 20000, {
      message: () => `did not reconnect; states ${states.join(',')}`,
    })
    origin.set('/doc', 'one 2 three 😀 four\n')
    await waitFor(() => text === origin.text('/doc'), 20000, {
      message: () => `after the restart: ${JSON.stringify(text)}; states ${states.join(',')}`,
    })
    assert.deepEqual(seen, ['snapshot', 'patch', 'patch'], 'resumed from its version: no second snapshot')
  } finally {
    sub.close()
    await proxy.stop()
    await origin.close()
  }
})
