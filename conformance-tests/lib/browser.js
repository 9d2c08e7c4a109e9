// Headless Chromium (/usr/bin/chromium, the Debian package "chromium")
// driven by playwright-core, for the tests of the pages: a missing
// Chromium fails the test; it is not skipped.

import assert from 'node:assert/strict'
import fs from 'node:fs'

export const CHROMIUM = '/usr/bin/chromium'

export const CHROMIUM_ARGS = [
  '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync',
]

/** playwright-core's chromium, after checking that the browser is installed. */
export async function chromiumDriver() {
  assert.ok(
    fs.existsSync(CHROMIUM),
    `${CHROMIUM} is missing: install the Debian package "chromium" (apt-get install -y chromium)`,
  )
  const { chromium } = await import('playwright-core')
  return chromium
}

/** A launched headless Chromium; close it with `browser.close()`. */
export async function launchChromium() {
  const chromium = await chromiumDriver()
  return chromium.launch({ executablePath: CHROMIUM, headless: true, args: CHROMIUM_ARGS })
}

/** Collects a page's console and page errors, for failure messages. */
export function recordConsole(page, into = []) {
  page.on('console', (m) => into.push(m.text()))
  page.on('pageerror', (e) => into.push('pageerror: ' + e.message))
  return into
}
