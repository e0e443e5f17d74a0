// page_script_check.js PAGE.html - runs the inline script of a `tdist-trace html` page against a
// small stand-in for the browser's DOM (the page's event groups, flow lines, axis and button,
// parsed from the HTML), then zooms in twice, pans and resets as a user would. Exits 0 when the
// script ran, every drawn element kept a finite position and width, zooming in widened the
// spans, and the axis has ticks; 1 otherwise (said on stderr). Used by test_trace when node is
// installed.
'use strict';
const fs = require('fs');
const html = fs.readFileSync(process.argv[2], 'utf8');

function El(tag, attrs, kids) {
  this.tag = tag;
  this.attrs = attrs || {};
  this.dataset = {};
  this.kids = kids || [];
  this.listeners = {};
  for (const k in this.attrs)
    if (k.startsWith('data-')) this.dataset[k.slice(5).replace(/-(.)/g, (m, c) => c.toUpperCase())] = this.attrs[k];
  for (let i = 0; i < this.kids.length; i++) this.kids[i].nextElementSibling = this.kids[i + 1] || null;
  this.firstElementChild = this.kids[0] || null;
}
El.prototype.setAttribute = function (k, v) { this.attrs[k] = String(v); };
El.prototype.getAttribute = function (k) { return this.attrs[k]; };
El.prototype.addEventListener = function (t, f) { this.listeners[t] = f; };

const evs = [], flows = [];
const evRe = /<g class="ev" data-t="([^"]+)" data-d="([^"]+)"><title>[\s\S]*?<\/title>(<rect[^>]*\/>)(<text[^>]*>[\s\S]*?<\/text>)?<\/g>/g;
for (let m; (m = evRe.exec(html));) {
  const rect = new El('rect', {x: /x="([^"]+)"/.exec(m[3])[1], width: /width="([^"]+)"/.exec(m[3])[1]});
  const kids = [new El('title'), rect];
  if (m[4]) kids.push(new El('text'));
  evs.push(new El('g', {'data-t': m[1], 'data-d': m[2]}, kids));
}
const flowRe = /<line class="flow" data-t="([^"]+)" data-t2="([^"]+)"/g;
for (let m; (m = flowRe.exec(html));) flows.push(new El('line', {'data-t': m[1], 'data-t2': m[2]}));
const sv = /<svg id="tl"[^>]*data-label="(\d+)" data-width="(\d+)" data-span="([^"]+)"/.exec(html);
const script = /<script>\n([\s\S]*?)<\/script>/.exec(html);
function fail(why) { process.stderr.write('page_script_check: ' + why + '\n'); process.exit(1); }
if (!sv || !script || evs.length === 0) fail('no timeline, script or events in the page');

const svg = new El('svg', {'data-label': sv[1], 'data-width': sv[2], 'data-span': sv[3]});
svg.querySelectorAll = (q) => (q === 'g.ev' ? evs : flows);
const axis = new El('g'), reset = new El('button');
global.document = {getElementById: (id) => (id === 'tl' ? svg : id === 'axis' ? axis : reset)};
global.window = {listeners: {}, addEventListener(t, f) { this.listeners[t] = f; }};
new Function(script[1])();

const widest = () => Math.max(...evs.map((e) => +e.kids[1].attrs.width));
const finite = () => evs.every((e) => isFinite(+e.kids[1].attrs.x) && isFinite(+e.kids[1].attrs.width)) &&
                     flows.every((f) => isFinite(+f.attrs.x1) && isFinite(+f.attrs.x2));
const w0 = widest();
if (!finite() || !/<text/.test(axis.innerHTML)) fail('the first drawing is not whole');
svg.listeners.wheel({preventDefault() {}, offsetX: +sv[1] + 100, deltaY: -1});
svg.listeners.wheel({preventDefault() {}, offsetX: +sv[1] + 100, deltaY: -1});
if (!(widest() > w0 * 1.5)) fail('zooming in did not widen the spans');
svg.listeners.mousedown({clientX: 500});
window.listeners.mousemove({clientX: 420});
window.listeners.mouseup();
if (!finite()) fail('panning left elements without a position');
reset.onclick();
if (!finite() || Math.abs(widest() - w0) > 1e-6 * Math.max(1, w0)) fail('reset did not return to the whole run');
console.log('page script ran: ' + evs.length + ' events, ' + flows.length + ' flows');
