// 17. The demo a new user gets from `cargo run --release`: the binary with
// no --upstream (its embedded demo origin), started in an empty directory
// with BRAID_HTTP_CLIENT unset, so nothing of conformance-tests/ can reach
// it. Two separate browser contexts (two users) open the page: it uses the
// client built into the binary, every subscription goes live, the clock's
// patches are applied in the page, and an edit saved from one page (PUT
// through the proxy) shows in the views of both, with non-BMP characters
// ahead of the change so that code-point ranges are exercised.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { startProxy, request } from '../lib/proxy.js'
import { waitFor } from '../lib/util.js'
import { launchChromium, recordConsole } from '../lib/browser.js'

test('the demo page works from the binary alone, and edits show in every view', { timeout: 120000 }, async () => {
  const empty = fs.mkdtempSync(path.join(os.tmpdir(), 'braid-proxy-demo-'))
  const env = { ...process.env }
  delete env.BRAID_HTTP_CLIENT
  const proxy = await startProxy({ cwd: empty, env })
  let browser
  try {
    // Nothing of braid-http is served: the page has only the built-in client.
    assert.equal((await request(`${proxy.url}/braid-http-client.js`)).status, 404)
    const own = await request(`${proxy.url}/braid-proxy-client.js`)
    assert.equal(own.status, 200)
    assert.match(own.body.toString(), /braidProxyClient/)

    browser = await launchChromium()
    const logs = []
    const open = async () => {
      const context = await browser.newContext()
      const page = await context.newPage()
      recordConsole(page, logs)
      await page.goto(`${proxy.url}/`)
      return page
    }
    const pages = [await open(), await open()]
    const state = (page) => page.evaluate(() => ({
      client: window.braidDemo?.client,
      braidFetch: typeof window.braid_fetch,
      subs: window.braidDemo?.subs ?? [],
    }))
    let last = []
    const explain = () => `page states: ${JSON.stringify(last)}\nbrowser console (last 20):\n${logs.slice(-20).join('\n')}`
    const current = async (p) => (await request(`${proxy.url}${p}`)).body.toString()

    // 1. Every subscription of both pages is live and shows the document.
    const allLive = async () => {
      last = await Promise.all(pages.map(state))
      for (const s of last) {
        if (s.subs.length !== 3 || !s.subs.every((x) => x.state === 'live' && x.version)) return false
        for (const x of s.subs) if (x.path !== '/clock' && x.text !== (await current(x.path))) return false
      }
      return true
    }
    await waitFor(allLive, 30000, { interval: 200, message: () => `not every subscription is live\n${explain()}` })
    for (const s of last) {
      assert.equal(s.client, 'braid-proxy', explain())
      assert.equal(s.braidFetch, 'undefined', `braid-http's client is not on the page\n${explain()}`)
      assert.deepEqual(s.subs.map((x) => x.path), ['/notes.txt', '/data.json', '/clock'])
    }
    assert.match(await pages[0].textContent('#json'), /"greeting": "hello"/)

    // 2. The clock ticks every second: its updates arrive as patches, and
    // the page's copy equals the proxy's.
    await waitFor(async () => {
      const clock = (await state(pages[0])).subs[2]
      return clock.patches >= 2 && clock.text === (await current('/clock'))
    }, 15000, { interval: 100, message: () => `the clock's patches did not apply\n${explain()}` })

    // 3. An edit from each page, saved with PUT through the proxy, shows
    // in both pages' text views; the second is a patch after a non-BMP
    // character (code points and UTF-16 units differ there).
    const edits = [
      [pages[0], 'Edited in the first browser: 😀 naïve text.\n'],
      [pages[1], 'Edited in the first browser: 😀 naïve text, then in the second.\n'],
    ]
    for (const [page, text] of edits) {
      await page.fill('#edit', text)
      await page.click('#save')
      let saved = ''
      await waitFor(async () => (saved = await page.textContent('#saved')) === 'saved', 10000, {
        message: () => `the save did not succeed: ${saved}\n${explain()}`,
      })
      assert.equal(await current('/notes.txt'), text, 'the PUT reached the demo origin')
      await waitFor(async () => {
        last = await Promise.all(pages.map(state))
        const views = await Promise.all(pages.map((p) => p.textContent('#text')))
        return views.every((v) => v === text)
      }, 15000, { interval: 100, message: () => `not every view shows ${JSON.stringify(text)}\n${explain()}` })
    }
    for (const s of last) {
      assert.ok(s.subs[0].patches >= 1, `the edits arrived as patches\n${explain()}`)
      assert.equal(s.subs[0].error, null, explain())
    }
  } finally {
    await browser?.close().catch(() => {})
    await proxy.stop()
    fs.rmSync(empty, { recursive: true, force: true })
  }
})
