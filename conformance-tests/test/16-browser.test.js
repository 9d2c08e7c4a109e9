// 16. A real browser: headless Chromium (/usr/bin/chromium, driven by
// playwright-core) opens examples/browser/ from one port and subscribes
// through the proxy on another (cross-origin, --cors-origin) with
// braid-http's browser client. Twelve subscriptions on one page are all
// live (past six, only multiplexing gets them a connection); a change at
// the origin shows on the page; the proxy is killed and restarted, and the
// page reconnects with its versions and catches up with patches, not
// snapshots. A missing Chromium fails the test; it is not skipped.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import fs from 'node:fs'
import http from 'node:http'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { startOrigin } from '../lib/origin.js'
import { startProxy } from '../lib/proxy.js'
import { waitFor, sleep } from '../lib/util.js'
import { CHROMIUM, CHROMIUM_ARGS, chromiumDriver, recordConsole } from '../lib/browser.js'

const here = path.dirname(fileURLToPath(import.meta.url))
const PAGE = path.join(here, '..', '..', 'examples', 'browser', 'index.html')
const CLIENT = path.join(here, '..', 'node_modules', 'braid-http', 'braid-http-client.js')
const OWN_CLIENT = path.join(here, '..', '..', 'examples', 'browser', 'braid-proxy-client.js')
const N = 12

/** Serves the example page, its own client, and the braid-http browser client from the npm package. */
async function startPageServer() {
  const server = http.createServer((req, res) => {
    const p = new URL(req.url, 'http://page.invalid').pathname
    const files = { '/': PAGE, '/braid-http-client.js': CLIENT, '/braid-proxy-client.js': OWN_CLIENT }
    const file = files[p]
    if (!file) return res.writeHead(404).end()
    const type = file.endsWith('.js') ? 'text/javascript' : 'text/html; charset=utf-8'
    res.writeHead(200, { 'content-type': type, 'cache-control': 'no-store' })
    res.end(fs.readFileSync(file))
  })
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve))
  return { server, url: `http://127.0.0.1:${server.address().port}` }
}

test('twelve live subscriptions in Chromium, cross-origin, across a proxy restart', { timeout: 120000 }, async () => {
  const chromium = await chromiumDriver()

  const origin = await startOrigin()
  origin.set('/notes.txt', 'Shared notes, first draft.\n', { contentType: 'text/plain; charset=utf-8' })
  origin.set('/data.json', '{"greeting": "hello", "count": 0}\n', { contentType: 'application/json' })
  origin.set('/clock', 'tick 0\n', { contentType: 'text/plain; charset=utf-8' })
  const page = await startPageServer()
  const proxyArgs = { upstream: origin.url, args: ['--cors-origin', page.url] }
  let proxy = await startProxy(proxyArgs)
  const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), 'braid-proxy-chromium-'))
  let context
  try {
    context = await chromium.launchPersistentContext(userDataDir, {
      executablePath: CHROMIUM,
      headless: true,
      args: CHROMIUM_ARGS,
    })
    const tab = context.pages()[0] ?? (await context.newPage())
    const logs = recordConsole(tab)
    await tab.goto(`${page.url}/?client=braid-http&proxy=${encodeURIComponent(proxy.url)}&n=${N}&more=/clock`)
    const subs = () => tab.evaluate(() => window.braidDemo?.subs ?? [])
    const texts = { '/notes.txt': () => origin.text('/notes.txt'), '/data.json': () => origin.text('/data.json'), '/clock': () => origin.text('/clock') }
    const show = (list) => JSON.stringify(list.map((s) => [s.i, s.path, s.state, s.version, s.reconnects, s.snapshots, s.patches, s.error]))
    let last = []
    const allLive = async (extra = () => true) => {
      last = await subs()
      return last.length === N && last.every((s) => s.state === 'live' && s.text === texts[s.path]() && extra(s))
    }
    const explain = () => `page state: ${show(last)}\nbrowser console (last 20): ${logs.slice(-20).join('\n')}`

    // 1. All twelve live at once: past six, only multiplexing can do it.
    await waitFor(allLive, 30000, { message: () => `not all ${N} subscriptions are live\n${explain()}` })
    const multiplexed = last.filter((s) => s.multiplexed).length
    assert.ok(multiplexed >= N - 6, `at least ${N - 6} subscriptions are multiplexed (${multiplexed})\n${explain()}`)
    // One watcher per resource, however many subscribers: the origin saw a
    // few GETs per path, not one per subscription.
    const notesGets = origin.count({ method: 'GET', path: '/notes.txt' })

    // 2. The origin changes; the page shows it.
    origin.set('/notes.txt', 'Shared notes, second draft.\n')
    await waitFor(async () => (await tab.textContent('#text')) === origin.text('/notes.txt'), 15000, {
      message: () => `the text view never showed the new content\n${explain()}`,
    })
    await waitFor(allLive, 15000, { message: () => `not all subscriptions caught up\n${explain()}` })
    assert.ok(origin.count({ method: 'GET', path: '/notes.txt' }) - notesGets < 60, 'fan-out: polling, not a GET per subscriber')

    // 3. Kill the proxy and start it again on the same port: every
    // subscription reconnects with its version, and gets no snapshot.
    const port = proxy.port
    proxy.child.kill('SIGKILL')
    await proxy.stop()
    await sleep(500)
    proxy = await startProxy({ ...proxyArgs, listen: `127.0.0.1:${port}` })
    await waitFor(() => allLive((s) => s.reconnects >= 1), 40000, {
      message: () => `the page did not reconnect every subscription\n${explain()}`,
    })
    assert.deepEqual(last.filter((s) => s.snapshotsSinceReconnect > 0).map((s) => s.i), [],
      `resumed at their versions: no snapshot after the restart\n${explain()}`)

    // 4. Changes after the restart arrive as patches.
    origin.set('/notes.txt', 'Shared notes, third draft, after the restart.\n')
    origin.set('/data.json', '{"greeting": "hello again", "count": 1}\n')
    await waitFor(() => allLive(), 20000, { message: () => `the page did not catch up after the restart\n${explain()}` })
    for (const s of last) {
      assert.equal(s.snapshotsSinceReconnect, 0, `sub ${s.i} (${s.path}) got a snapshot after the restart\n${explain()}`)
      if (s.path !== '/clock') assert.ok(s.patchesSinceReconnect >= 1, `sub ${s.i} (${s.path}) caught up with a patch\n${explain()}`)
    }
    // The page renders on the next animation frame after a subscription's
    // state changes, so its views can be a frame behind the state checked
    // above: wait for them.
    await waitFor(async () => (await tab.textContent('#text')) === origin.text('/notes.txt'), 5000, {
      message: () => `the text view never showed the third draft\n${explain()}`,
    })
    await waitFor(async () => /hello again/.test(await tab.textContent('#json')), 5000, {
      message: () => `the JSON view never showed the new greeting\n${explain()}`,
    })
    if (process.env.BRAID_CONFORMANCE_VERBOSE) console.error(explain())
  } finally {
    await context?.close().catch(() => {})
    await proxy.stop()
    page.server.closeAllConnections?.()
    page.server.close()
    await origin.close()
    fs.rmSync(userDataDir, { recursive: true, force: true })
  }
})
